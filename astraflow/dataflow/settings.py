"""Settings of the dataflow: feeder and curators, the collector's verdicts, batch formation, lineage."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from astraflow.dataflow.curators import CURATORS
from astraflow.workflows.datasets import DatasetSettings

CuratorName = Literal[tuple(CURATORS)]  # type: ignore[valid-type]
"""A registered curator (`dataflow.curators`): adding one there adds it here."""


class GresoSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    p_init: float = Field(0.5, gt=0, le=1)
    """Start value of p_easy and p_hard: a prompt with a zero-variance streak s is submitted with p^s."""
    floor: float = Field(0.05, gt=0, le=1)
    """Least probability of submitting any prompt, so a skipped prompt is re-checked now and then."""
    step: float = Field(0.05, gt=0, le=1)
    """How far p moves each version toward the target."""
    target_easy: float = Field(0.1, ge=0, le=1)
    """Wanted share of all-correct (zero-variance, mean reward >= 0.5) groups among those collected."""
    target_hard: float = Field(0.1, ge=0, le=1)
    """Wanted share of all-wrong (zero-variance, mean reward < 0.5) groups among those collected."""


class FeederSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    workflow: str = "rlvr"
    """Workflow the RaaS runs for each prompt group (a registered name or `module:Class`)."""
    n_samples: int = Field(8, ge=1)
    """Samples per prompt group."""
    curator: CuratorName = "accept_all"
    """Which rows are submitted: a curator registered in `dataflow.curators`, whose class says what it
    skips (`accept_all`: none; `greso`: prompts with a zero-variance streak, with an adaptive
    probability)."""
    backlog_factor: float = Field(2.0, gt=0)
    """Submit while undelivered + pending prompt groups < factor x the slots of the live RaaS pool."""
    min_backlog: int = Field(8, ge=1)
    """Backlog allowed even when no RaaS is alive (a worker that joins finds work at once)."""
    max_worker_slots: int = Field(1024, ge=1)
    """Most slots one RaaS heartbeat counts for, whatever it advertises."""
    capacity_horizon_s: float = Field(60.0, gt=0)
    """A heartbeat counts at most the groups the dataflow collects from its worker in this long, at the
    rate it has collected them, if that is more than a new worker's allowance (`feeder.START_SLOTS`):
    slots the worker only claims, in its heartbeat or otherwise, do not feed the backlog."""
    max_ready_batches: float = Field(4.0, ge=1)
    """Stop submitting while the ready sets hold this many batches' worth of units per model (groups, or
    samples: a group may hold fewer than `n_samples`), each model's set a batch at least - a slow
    trainer; at least one, or no batch could form."""
    interval_ms: int = Field(200, gt=0)
    """How long the feeder waits when the backlog is full, at most: this replica's collector wakes it as
    soon as it settles rollouts (their prompts' slots are free then), in sync mode its barrier at a new
    version; the interval only bounds how late it sees what it is not told (another replica's collector,
    a RaaS that joined). Each look is two Redis round trips and a script: at 50 ms, a sixth of the
    dataflow's CPU."""
    sync_oversubmit: float = Field(2.0, ge=1)
    """Lockstep (`trainer.mode: sync`): prompt groups in flight per group the batch still needs, at most
    the backlog. Dynamic sampling drops the groups whose rewards are all equal (about half of them on the
    default recipe), so submitting only what is needed takes several waves of generation per version;
    what is left over when the batch forms is dropped as stale."""
    solved_alpha: float = Field(0.5, gt=0, le=1)
    """filter_solved: weight of the newest group in a prompt's success-rate EWMA."""
    solved_threshold: float = Field(0.9, ge=0, le=1)
    """filter_solved: skip prompts whose success-rate EWMA is above this."""
    greso: GresoSettings = Field(default_factory=GresoSettings)
    skip_after_groups: int = Field(1, ge=1)
    """skip_zero_variance: zero-variance groups in a row (all solved or all failed) before a prompt is
    skipped."""
    skip_versions: int = Field(1000, ge=1)
    """skip_zero_variance: versions a prompt is skipped for after its last zero-variance group. A row
    comes back once per pass over the dataset, so this only acts when a pass takes fewer versions."""


class CollectorSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    normalize: Literal["group", "leave_one_out", "none"] = "group"
    """Advantage: (r - group mean) / (group std + epsilon); r - mean of the others; or r itself."""
    epsilon: float = Field(1e-6, gt=0)
    dynamic_sampling: bool = True
    """Drop groups whose rewards are all equal (no learning signal)."""
    reward_range: tuple[float, float] = (-1.0, 1.0)
    """Least and greatest reward a trajectory may carry: a rollout with one outside is dead-lettered
    (a finite but huge reward from one worker would otherwise decide the run's reward target). Every
    shipped reward gives 0 to 1; widen it for a reward of your own that scales otherwise."""
    filters: list[str] = Field(default_factory=list)
    """Group filters by name (`drop_truncated`, or `module:function`), applied in order."""
    order: Literal["edf", "fifo"] = "edf"
    """Ready-set order: earliest deadline (min token version + max staleness) first, or arrival."""
    read_count: int = Field(64, ge=1)
    """Rollout entries read and committed per step."""
    read_interval_ms: int = Field(20, ge=0)
    """Least time between two reads of `rollouts`. Groups arrive one by one as a RaaS finishes them; each
    read and commit costs round trips, so taking the few that arrived in this time together costs less
    (the default recipe collects ~150 groups a second). 0: read again as soon as the last read is judged."""

    @model_validator(mode="after")
    def _range(self) -> CollectorSettings:
        low, high = self.reward_range
        if not (math.isfinite(low) and math.isfinite(high) and low < high):
            raise ValueError(f"collector.reward_range: [{low}, {high}] is not a finite range, low < high")
        return self


class BatchSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    size: int = Field(128, ge=1)
    """Batch size in `unit`s; groups are never split, so a batch has at least this many."""
    unit: Literal["samples", "groups"] = "samples"
    replay_ratio: float = Field(0.0, ge=0, lt=1)
    """Share of each batch taken from the replay set of recently trained groups."""
    replay_selection: Literal["latest", "uniform"] = "latest"
    replay_capacity: int = Field(64, ge=1)
    """Groups kept in the replay set (the oldest leave first)."""
    prefetch: int = Field(2, ge=1)
    """Batches kept formed and unread by the trainer."""


class DataflowSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = ""
    """Consumer name of this replica; default `dataflow-<host>-<pid>`."""
    max_staleness_steps: int = Field(4, ge=0)
    """Drop a group when trainer_version - min_token_version exceeds this, trainer_version counted at the
    earliest it can train the group: the trainer's newest version plus one per batch formed ahead of it
    (`batch.prefetch`). The version it trains at can still be later; the trainer reports it as staleness."""
    dataset: DatasetSettings = Field(default_factory=DatasetSettings)
    """Where prompts come from."""
    feeder: FeederSettings = Field(default_factory=FeederSettings)
    collector: CollectorSettings = Field(default_factory=CollectorSettings)
    batch: BatchSettings = Field(default_factory=BatchSettings)
    trace_every: int = Field(16, ge=0)
    """One prompt group in this many (by dataset position) keeps a lineage for `astraflow trace`; 1:
    every group, 0: none. The ledger counts every group all the same."""
    trace_retention_s: int = Field(3600, gt=0)
    """How long a prompt group's lineage is kept, from its submission: about a run's working time, so
    that a stopped run's traces leave a shared Redis within it."""
    trace_max_groups: int = Field(10_000, ge=1)
    """Most lineages kept (about 1 KB each in Redis: ~10 MB at the default); the oldest go first."""
    metrics_port: int = Field(0, ge=0, le=65535)
    """Port of the replica's Prometheus /metrics endpoint (rollouts collected, mean reward, eval rows;
    labels run, worker, policy); 0 = not served."""
    metrics_host: str = "127.0.0.1"
    """Address the /metrics endpoint listens on: this host only; `0.0.0.0` (all interfaces) lets a
    Prometheus in another pod scrape it."""

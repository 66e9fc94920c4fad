"""Evaluation as a service: the `eval` settings, the eval prompt groups of a version, and their scores.

Every `eval.every`-th version is an eval version (its trainers publish it flagged), and with `eval.every_s`
the first version published that many seconds after the last eval version. When the barrier
announces one, the dataflow submits the eval datasets' rows as flagged prompt groups on `prompts`
(`Evals.submit`, once per version across replicas); every RaaS runs them on exactly that version; the
collector scores them (`score`) into the metrics stream (`kind=eval`) and never into a ready set.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import structlog
from pydantic import BaseModel, ConfigDict, Field, model_validator

from astraflow.messages import PromptGroup, RolloutGroup, Trajectory, encode
from astraflow.streams.schema import EVAL_UID
from astraflow.workflows.datasets import DatasetSettings, load_rows

if TYPE_CHECKING:
    from astraflow.dataflow.store import Store
    from astraflow.streams.runstate import RunState

log = structlog.get_logger(__name__)
HELD_OUT_SEED = 1_000_003
"""Seed of the eval rows of a built-in task: apart from the training rows (seeded by run.seed)."""

EvalMetric = Callable[[Sequence[Trajectory]], float]
"""`(one row's trajectories of one policy) -> value`; a dataset's value is the mean over its rows."""
METRICS: dict[str, EvalMetric] = {}


def eval_metric(name: str):
    """Function decorator: register an eval metric under `name` (eval.metrics)."""

    def register(fn: EvalMetric) -> EvalMetric:
        METRICS[name] = fn
        return fn

    return register


@eval_metric("pass@1")
def pass_at_1(trajectories: Sequence[Trajectory]) -> float:
    """Share of the row's samples that get the full reward (1.0)."""
    return float(np.mean([t.reward >= 1.0 for t in trajectories]))


@eval_metric("mean_reward")
def mean_reward(trajectories: Sequence[Trajectory]) -> float:
    return float(np.mean([t.reward for t in trajectories]))


class EvalDataset(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9._-]{1,64}$")
    """Names the results (`summary.json`, the plot) and the eval groups' uids."""
    dataset: DatasetSettings = Field(default_factory=DatasetSettings)
    """Like `dataflow.dataset`; a built-in task's rows are drawn apart from the training rows."""
    n: int = Field(64, ge=1)
    """Rows evaluated at each eval version (the first n)."""
    reward: str = ""
    """The reward that scores the rows (default: the row's own, else the recipe's)."""


class EvalSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    every: int = Field(0, ge=0)
    """Every this many versions (and at version 0) is an eval version; 0 = none by count."""
    every_s: float = Field(0.0, ge=0)
    """Also (or instead: `every: 0`) the first version a trainer publishes this many seconds after its last
    eval version, and version 0; 0 = none by time. An eval holds later versions back until its groups are
    collected, so a cadence in versions costs a fast run more (the default recipe: 11% of its time to
    target with `every: 10`); by time its cost is bounded, and the results come as often on any machine.
    With several trained policies each trainer keeps its own clock, and a version any of them flags is
    evaluated."""
    datasets: list[EvalDataset] = Field(default_factory=list)
    metrics: list[str] = Field(default_factory=lambda: ["pass@1", "mean_reward"])
    """Registered eval metrics (`pass@1`, `mean_reward`, `@eval_metric`), else a workflow metric
    (`tool_call`, ...) averaged over the trajectories that report it."""
    greedy: bool = True
    """Sample eval rows greedily (else with the RaaS's sampling)."""
    n_samples: int = Field(1, ge=1)
    """Samples per eval row."""
    max_new_tokens: int | None = Field(None, ge=1)
    """Token limit of eval samples (default: the RaaS's)."""
    timeout_s: float = Field(120.0, gt=0)
    """The barrier holds later versions back until an eval version's groups are all collected, or this
    long after they were submitted (a lost eval group cannot stall training)."""

    @model_validator(mode="after")
    def _datasets_named(self) -> EvalSettings:
        if (self.every or self.every_s) and not self.datasets:
            raise ValueError("eval.every or eval.every_s is set but eval.datasets is empty")
        names = [d.name for d in self.datasets]
        if len(set(names)) != len(names):
            raise ValueError(f"eval.datasets: names repeat: {names}")
        return self

    def sampling(self) -> dict[str, float]:
        out: dict[str, float] = {"temperature": 0.0} if self.greedy else {}
        if self.max_new_tokens is not None:
            out["max_new_tokens"] = self.max_new_tokens
        return out


def eval_uid(version: int, dataset: str, row: int) -> str:
    return EVAL_UID(version, dataset, row)


class Evals:
    """The dataflow's side of evaluation: submits a version's eval groups, holds the barrier meanwhile."""

    def __init__(self, settings: EvalSettings, workflow: str, models: Sequence[str]) -> None:
        self.settings, self.workflow, self.models = settings, workflow, list(models)
        self.rows: dict[str, list[dict[str, Any]]] = {}
        for d in settings.datasets:
            rows = load_rows(d.dataset, HELD_OUT_SEED)[: d.n]
            if not rows:
                raise ValueError(f"eval dataset {d.name}: no rows")
            self.rows[d.name] = [{**r, "reward": d.reward} if d.reward else r for r in rows]

    def due(self, state: RunState) -> int | None:
        """The newest announced eval version whose groups were not submitted yet (None: none)."""
        notice = state.notice
        if not self.rows or notice is None:
            return None
        newest = max((v for v in state.eval_versions() if v <= notice), default=None)
        return None if newest is None or state.eval_submitted(newest) is not None else newest

    def holds(self, state: RunState, version: int) -> bool:
        """Whether the eval of announced `version` holds later notices back: its groups are not submitted
        yet, or not all collected and submitted less than `timeout_s` ago."""
        if not self.rows or not state.is_eval(version):
            return False
        submitted = state.eval_submitted(version)
        if submitted is None:
            return True
        return state.eval_pending(version) > 0 and time.time() - submitted < self.settings.timeout_s

    def groups(self, version: int) -> list[PromptGroup]:
        now, sampling = time.time(), self.settings.sampling()
        return [
            PromptGroup(
                uid=eval_uid(version, name, i),
                workflow=self.workflow,
                models=self.models,
                n_samples=self.settings.n_samples,
                version=version,
                sample=row,
                submitted_at=now,
                eval_version=version,
                eval_dataset=name,
                sampling=sampling,
            )
            for name, rows in self.rows.items()
            for i, row in enumerate(rows)
        ]

    async def submit(self, store: Store, version: int) -> int:
        """Submit the eval groups of `version` unless some replica did; returns groups submitted."""
        rows = {name: len(rows) for name, rows in self.rows.items()}
        n = await store.submit_eval(version, [encode(g) for g in self.groups(version)], rows)
        if n:
            log.info("eval_submitted", version=version, groups=n)
        return n


def score(group: RolloutGroup, trained: Sequence[str], metrics: Sequence[str]) -> tuple[dict, str]:
    """Per policy, the eval metrics of one collected eval row; or ({}, reason) when it is dropped: it
    failed, or a trained policy's tokens are not all of the eval version."""
    if group.error or not group.trajectories:
        return {}, "failed"
    ok = [t for t in group.trajectories if t.error is None]
    for t in ok:
        if t.model in trained and np.any(t.versions[t.loss_mask != 0] != group.eval_version):
            return {}, "wrong_version"
    out: dict[str, dict[str, float]] = {}
    for model in sorted({t.model for t in ok}):
        mine = [t for t in ok if t.model == model]
        values = {}
        for name in metrics:
            if name in METRICS:
                values[name] = METRICS[name](mine)
            elif reported := [t.metrics[name] for t in mine if name in t.metrics]:
                values[name] = float(np.mean(reported))
        out[model] = values
    return out, ""

"""How many RaaS workers a run needs, and why: the plan `astraflow scale` prints and serves.

Demand is what the trainers *could* take, not what they took: a trainer starved by a small pool consumes
only what the pool makes, so its consumption alone would never ask for more workers. From each trainer's
recent steps in `metrics`, its rate while not waiting for a batch (samples per busy second) is turned into
prompt groups per second the pool must produce: divided by the samples per group, by the share of
collected groups that reach a batch (the rest are dropped: stale, zero variance, ...; from the ledger),
and times the share of a batch that is fresh (not replay). With several trained policies every group
feeds each of them, so the largest figure counts. Supply is a worker's rate while it generates: groups
handed off per generating second, from the heartbeats (`raas:<id>`). Then

    needed = ceil(demand x headroom / groups per worker)   (at least 1)

`plan` is the pure computation; `read_plan` gathers its inputs from Redis, `write_plan` stores the figure
in the run's `scale` hash.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from redis.exceptions import NoPermissionError

from astraflow.config import Settings
from astraflow.dataflow.ledger import read_ledger
from astraflow.launch.progress import read_heartbeats
from astraflow.messages import Heartbeat
from astraflow.streams import Bus
from astraflow.streams.records import RolloutStats, TrainerStep, decode_record

HEADROOM = 1.2
"""Default margin over the demand: weight loads pause generation, episodes vary in length."""
WINDOW_STEPS = 20
"""Default number of recent trainer steps the demand is measured over."""
METRICS_SCAN = 5000
"""Newest `metrics` entries read to find those steps (the stream is capped)."""


@dataclass(frozen=True)
class Demand:
    """One trained policy's appetite, from its recent steps."""

    model: str
    steps: int
    consumed_samples_per_s: float
    """Samples per second it took over the window (wall time, waits included)."""
    capacity_samples_per_s: float
    """Samples per second it would take if a batch were always ready (waits excluded)."""
    samples_per_group: float
    kept: float
    """Share of collected groups that reach a batch (trained / (trained + dropped))."""
    fresh: float
    """Share of a batch taken from new rollouts (1 - replay ratio)."""

    @property
    def groups_per_s(self) -> float:
        """Prompt groups per second the pool must produce to keep this trainer busy."""
        return self.capacity_samples_per_s * self.fresh / self.samples_per_group / max(self.kept, 1e-9)


@dataclass(frozen=True)
class Pool:
    workers: int
    groups_per_s: float
    """What the pool produced per second over the window (all workers)."""
    per_worker_groups_per_s: float
    """Groups one worker hands off per second while generating (mean over the pool)."""


@dataclass(frozen=True)
class Plan:
    demands: list[Demand]
    pool: Pool
    headroom: float
    needed: int
    reason: str

    @property
    def demand_groups_per_s(self) -> float:
        return max((d.groups_per_s for d in self.demands), default=0.0)

    def as_fields(self) -> dict[str, str]:
        """The `scale` hash."""
        return {
            "needed": str(self.needed),
            "workers": str(self.pool.workers),
            "demand_groups_per_s": f"{self.demand_groups_per_s:.4f}",
            "pool_groups_per_s": f"{self.pool.groups_per_s:.4f}",
            "per_worker_groups_per_s": f"{self.pool.per_worker_groups_per_s:.4f}",
            "headroom": str(self.headroom),
            "reason": self.reason,
            "updated_at": f"{time.time():.3f}",
        }


def plan(demands: list[Demand], pool: Pool, headroom: float = HEADROOM) -> Plan:
    """The workers needed to keep every trainer busy, with the reasoning in words."""
    keep = max(pool.workers, 1)
    busy = [d for d in demands if d.capacity_samples_per_s > 0]
    if not busy:
        return Plan(demands, pool, headroom, keep, "no trainer step measured yet: keep the pool as it is")
    if pool.workers == 0:
        return Plan(demands, pool, headroom, keep, "no RaaS worker alive: start one to measure its rate")
    if pool.per_worker_groups_per_s <= 0:
        return Plan(demands, pool, headroom, keep, "no RaaS production measured yet: keep the pool as it is")
    top = max(busy, key=lambda d: d.groups_per_s)
    exact = top.groups_per_s * headroom / pool.per_worker_groups_per_s
    needed = max(1, math.ceil(exact - 1e-9))
    reason = (
        f"trainer {top.model} takes {top.capacity_samples_per_s:.1f} samples/s when fed"
        f" / {top.samples_per_group:g} samples per group / {top.kept:.0%} kept x {top.fresh:.0%} fresh"
        f" = {top.groups_per_s:.2f} groups/s; x headroom {headroom:g}"
        f" / {pool.per_worker_groups_per_s:.2f} groups/s per worker = {exact:.2f} -> {needed}"
    )
    return Plan(demands, pool, headroom, needed, reason)


def trainer_rates(steps: list[dict]) -> tuple[float, float]:
    """(consumed, capacity) samples per second of one trainer's steps (oldest first; each with `time`,
    `samples`, `step_s`, `wait_s`). Over two or more steps the first only marks the start; one step gives
    its own compute rate for both."""
    if not steps:
        return 0.0, 0.0
    if len(steps) == 1:
        rate = steps[0]["samples"] / steps[0]["step_s"] if steps[0]["step_s"] > 0 else 0.0
        return rate, rate
    span = steps[-1]["time"] - steps[0]["time"]
    later = steps[1:]
    samples = sum(s["samples"] for s in later)
    busy = max(span - sum(s.get("wait_s", 0.0) for s in later), sum(s["step_s"] for s in later))
    return (samples / span if span > 0 else 0.0), (samples / busy if busy > 0 else 0.0)


def pool_rates(beats: list[Heartbeat], before: dict[tuple[str, float], Heartbeat] | None = None) -> Pool:
    """The pool's production from its heartbeats: since each worker started, or since `before` (the same
    workers' earlier beats, keyed by (uid, started_at)) when given."""
    groups = generating = produced = 0.0
    for hb in beats:
        base = (before or {}).get((hb.uid, hb.started_at))
        g = hb.groups - (base.groups if base else 0)
        gen = hb.generating_s - (base.generating_s if base else 0.0)
        span = hb.updated_at - (base.updated_at if base else hb.started_at)
        groups += g
        generating += gen
        produced += g / span if span > 0 else 0.0
    per_worker = groups / generating if generating > 0 else 0.0
    return Pool(len(beats), produced, per_worker)


async def read_demands(bus: Bus, settings: Settings, window: int = WINDOW_STEPS) -> list[Demand]:
    """Each trained policy's demand, from its last `window` steps in `metrics` and the ledger."""
    models = settings.trained
    steps: dict[str, list[dict]] = {m: [] for m in models}
    per_group: dict[str, list[int]] = {m: [0, 0] for m in models}
    for _, raw in await bus.redis.xrevrange(bus.keys.metrics, count=METRICS_SCAN):
        r = decode_record(raw)
        if not isinstance(r, TrainerStep | RolloutStats) or r.model not in steps:
            continue
        if isinstance(r, TrainerStep) and len(steps[r.model]) < window:
            steps[r.model].append({**r.stats, "time": r.time})
        elif isinstance(r, RolloutStats):
            per_group[r.model][0] += r.samples
            per_group[r.model][1] += r.groups
    ledger = await read_ledger(bus, models)
    replay = settings.dataflow.batch.replay_ratio
    out = []
    for m in models:
        consumed, capacity = trainer_rates(sorted(steps[m], key=lambda s: s["time"]))
        samples, groups = per_group[m]
        lm = ledger.models[m]
        settled = lm.trained + lm.dropped_total
        out.append(
            Demand(
                model=m,
                steps=len(steps[m]),
                consumed_samples_per_s=consumed,
                capacity_samples_per_s=capacity,
                samples_per_group=samples / groups if groups else float(settings.dataflow.feeder.n_samples),
                kept=lm.trained / settled if settled else 1.0,
                fresh=1.0 - replay,
            )
        )
    return out


async def read_plan(
    bus: Bus,
    settings: Settings,
    headroom: float = HEADROOM,
    window: int = WINDOW_STEPS,
    before: dict[tuple[str, float], Heartbeat] | None = None,
) -> tuple[Plan, list[Heartbeat]]:
    """The plan from what Redis holds now, and the heartbeats it used (the next call's `before`)."""
    beats = await read_heartbeats(bus)
    return plan(await read_demands(bus, settings, window), pool_rates(beats, before), headroom), beats


async def write_plan(bus: Bus, p: Plan) -> bool:
    """Store the plan in the run's `scale` hash; False when this Redis user may not write (the read-only
    `observer` ACL user: the figure is then only printed or served)."""
    try:
        await bus.redis.hset(bus.keys.scale, mapping=p.as_fields())
    except NoPermissionError:
        return False
    return True


def render(p: Plan, run: str) -> str:
    """One table: consumption, production per worker, current and needed workers, the reasoning."""
    rows = [
        ("run", run),
        *[
            (
                f"trainer {d.model}",
                f"{d.consumed_samples_per_s:.1f} samples/s consumed, {d.capacity_samples_per_s:.1f} when fed"
                f" ({d.steps} steps); {d.groups_per_s:.2f} groups/s needed",
            )
            for d in p.demands
        ],
        ("RaaS pool", f"{p.pool.groups_per_s:.2f} groups/s produced"),
        ("per worker", f"{p.pool.per_worker_groups_per_s:.2f} groups/s while generating"),
        ("headroom", f"{p.headroom:g}"),
        ("workers", str(p.pool.workers)),
        ("needed", str(p.needed)),
        ("why", p.reason),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)

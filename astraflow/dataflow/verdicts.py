"""What the collector decides for one rollout group, per model: failed, filtered, zero variance, or
accepted with normalised advantages. Pure functions; the staleness check is the store's (it needs the
trainer version at the instant of the write)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from astraflow.columnar import column
from astraflow.dataflow.checks import InvalidRollout, Owned
from astraflow.dataflow.settings import CollectorSettings
from astraflow.dataflow.steps import Collected, Part
from astraflow.messages import RolloutGroup, SampleGroup, Trajectory, pack
from astraflow.streams.schema import Trace
from astraflow.workflows.api import _resolve

GroupFilter = Callable[[str, Sequence[Trajectory]], bool]
"""`(model, trajectories) -> keep`: a user filter of accepted groups, registered by name."""
FILTERS: dict[str, GroupFilter] = {}

# Drop reasons counted in the ledger (plus `stale_ingest`/`stale_wait` from the scripts, `filter:<name>`).
FAILED, ZERO_VARIANCE = "failed", "zero_variance"


def group_filter(name: str):
    """Function decorator: register a group filter under `name` (collector.filters)."""

    def register(fn: GroupFilter) -> GroupFilter:
        FILTERS[name] = fn
        return fn

    return register


@group_filter("drop_truncated")
def drop_truncated(model: str, trajectories: Sequence[Trajectory]) -> bool:
    """Keep a group unless every trajectory hit the token limit (nothing finished to learn from)."""
    return any(t.finish_reason != "length" for t in trajectories)


def resolve_filter(name: str) -> GroupFilter:
    """A registered filter or a `module:function`: filters are named by the recipe alone, never by data."""
    return _resolve(name, FILTERS, "group filter", allowed=(name,))


FLOAT32_MAX = float(np.finfo(np.float32).max)


def advantages(rewards: Sequence[float], how: str, epsilon: float) -> np.ndarray:
    """Per-trajectory advantages of one group's rewards (float32; NaN where the rewards' spread overflows,
    or an advantage is past float32's range). A group has a handful of rewards: plain floats, exactly
    rounded sums (`math.fsum`), no numpy call per group."""
    r = [float(x) for x in rewards]
    n = len(r)
    if how == "group":
        mean = math.fsum(r) / n
        std = math.sqrt(math.fsum((x - mean) * (x - mean) for x in r) / n)
        adv = [(x - mean) / (std + epsilon) if math.isfinite(std) else math.nan for x in r]
    elif how == "leave_one_out":
        total = math.fsum(r)
        adv = [x - (total - x) / max(n - 1, 1) for x in r]
    elif how == "none":
        adv = r
    else:
        raise ValueError(f"unknown normalisation: {how!r}")
    return np.array([a if abs(a) <= FLOAT32_MAX else math.nan for a in adv], dtype=np.float32)


def _metric_sums(metrics: Iterable[Mapping[str, float]]) -> dict[str, tuple[float, int]]:
    """Per workflow metric: (sum, trajectories reporting it), over the trajectories' `metrics`."""
    sums: dict[str, tuple[float, int]] = {}
    for values in metrics:
        for name, value in values.items():
            total, n = sums.get(name, (0.0, 0))
            sums[name] = (total + float(value), n + 1)
    return sums


class Judge:
    """Decides each model's part of a rollout group under the collector settings."""

    def __init__(self, settings: CollectorSettings, models: Sequence[str]) -> None:
        self.settings, self.models = settings, list(models)
        self.filters = [(name, resolve_filter(name)) for name in settings.filters]

    def __call__(self, entry_id: str, group: RolloutGroup, raw: bytes, owned: Owned) -> Collected:
        """Decide `group`, whose `data` bytes are `raw` (kept as they are in the accepted parts), by what
        `check_values` found in it (`owned`)."""
        trajs = group.trajectories
        rewards, metrics = column(trajs, "reward"), column(trajs, "metrics")
        named = group.models or sorted(set(column(trajs, "model")))
        models = [m for m in named if m in self.models] or self.models  # a policy not trained: no part
        mine = {m: owned.get(m, ([], None)) for m in models}
        scored = {m: [rewards[i] for i in mine[m][0]] for m in models}
        parts = [self._part(group, raw, m, *mine[m], scored[m]) for m in models]
        ranges = [versions for _, versions in mine.values() if versions is not None]
        first = scored[models[0]]
        trace = {Trace.raas: group.raas}
        if ranges:
            trace[Trace.token_versions] = f"{min(r[0] for r in ranges)}..{max(r[1] for r in ranges)}"
        if group.error:
            trace[Trace.error] = group.error[:500]
        return Collected(
            entry_id=entry_id,
            uid=group.uid,
            parts=parts,
            rewards={m: (sum(r) / len(r), len(r)) for m, r in scored.items() if r},
            zero_variance=len(first) > 1 and min(first) == max(first),
            trace=trace,
            metrics={m: _metric_sums(metrics[i] for i in mine[m][0]) for m in models},
        )

    def _part(
        self,
        group: RolloutGroup,
        raw: bytes,
        model: str,
        mine: list[int],
        versions: tuple[int, int] | None,
        rewards: list[float],
    ) -> Part:
        """The part of `model`, whose trajectories that did not fail are at `mine` (with `rewards`, and
        `versions` the range of their trained tokens' weight versions)."""
        if group.error or versions is None:
            return Part(model, FAILED, 0, len(mine))
        min_version, max_version = versions
        if self.settings.dynamic_sampling and len(mine) > 1 and min(rewards) == max(rewards):
            return Part(model, ZERO_VARIANCE, min_version, len(mine))
        for name, keep in self.filters:
            if not keep(model, [group.trajectories[i] for i in mine]):
                return Part(model, f"filter:{name}", min_version, len(mine))
        adv = advantages(rewards, self.settings.normalize, self.settings.epsilon)
        if not np.isfinite(adv).all():  # finite rewards so large that their spread overflows
            raise InvalidRollout(f"advantages of {model} are not finite (rewards {rewards[:8]})")
        samples = SampleGroup(
            uid=group.uid,
            model=model,
            min_version=min_version,
            max_version=max_version,
            rollout=raw,
            indices=mine,
            advantages=adv,
            submitted_version=group.version,
            raas=group.raas,
        )
        return Part(model, "", min_version, len(mine), pack(samples))

"""What the collector decides for one rollout group, per model: failed, filtered, zero variance, or
accepted with normalised advantages. Pure functions; the staleness check is the store's (it needs the
trainer version at the instant of the write)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np

from astraflow.dataflow.settings import CollectorSettings
from astraflow.dataflow.store import Collected, Part
from astraflow.messages import RolloutGroup, SampleGroup, Trajectory, pack
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


def advantages(rewards: np.ndarray, how: str, epsilon: float) -> np.ndarray:
    """Per-trajectory advantages of one group's rewards."""
    r = rewards.astype(np.float64)
    if how == "group":
        adv = (r - r.mean()) / (r.std() + epsilon)
    elif how == "leave_one_out":
        adv = r - (r.sum() - r) / max(len(r) - 1, 1)
    elif how == "none":
        adv = r
    else:
        raise ValueError(f"unknown normalisation: {how!r}")
    return adv.astype(np.float32)


def _version_range(trajectories: Sequence[Trajectory]) -> tuple[int, int] | None:
    """(oldest, newest) weight version of the trained tokens of `trajectories`; None when they have none."""
    if not trajectories:
        return None
    versions = np.concatenate([t.versions for t in trajectories])
    trained = versions[np.concatenate([t.loss_mask for t in trajectories]) != 0]
    return (int(trained.min()), int(trained.max())) if len(trained) else None


def _metric_sums(trajectories: Iterable[Trajectory]) -> dict[str, tuple[float, int]]:
    """Per workflow metric: (sum, trajectories reporting it)."""
    sums: dict[str, tuple[float, int]] = {}
    for t in trajectories:
        for name, value in t.metrics.items():
            total, n = sums.get(name, (0.0, 0))
            sums[name] = (total + float(value), n + 1)
    return sums


class Judge:
    """Decides each model's part of a rollout group under the collector settings."""

    def __init__(self, settings: CollectorSettings, models: Sequence[str]) -> None:
        self.settings, self.models = settings, list(models)
        self.filters = [(name, resolve_filter(name)) for name in settings.filters]

    def __call__(self, entry_id: str, group: RolloutGroup, raw: bytes) -> Collected:
        """Decide `group`, whose `data` bytes are `raw` (kept as they are in the accepted parts)."""
        named = group.models or sorted({t.model for t in group.trajectories})
        models = [m for m in named if m in self.models] or self.models  # a policy not trained: no part
        decided = [self._part(group, raw, m) for m in models]
        parts = [part for part, _ in decided]
        ranges = [r for _, r in decided if r is not None]
        ok = [t for t in group.trajectories if t.error is None]
        scored = {m: [t.reward for t in ok if t.model == m] for m in models}
        first = scored[models[0]]
        trace = {"raas": group.raas}
        if ranges:
            trace["token_versions"] = f"{min(r[0] for r in ranges)}..{max(r[1] for r in ranges)}"
        if group.error:
            trace["error"] = group.error[:500]
        return Collected(
            entry_id=entry_id,
            uid=group.uid,
            parts=parts,
            rewards={m: (sum(r) / len(r), len(r)) for m, r in scored.items() if r},
            zero_variance=len(first) > 1 and min(first) == max(first),
            trace=trace,
            metrics={m: _metric_sums(t for t in ok if t.model == m) for m in models},
        )

    def _part(self, group: RolloutGroup, raw: bytes, model: str) -> tuple[Part, tuple[int, int] | None]:
        """The part of `model` and the version range of its trained tokens."""
        mine = [i for i, t in enumerate(group.trajectories) if t.model == model and t.error is None]
        ok = [group.trajectories[i] for i in mine]
        versions = _version_range(ok)
        if group.error or versions is None:
            return Part(model, FAILED, 0, len(ok)), versions
        min_version, max_version = versions
        rewards = [t.reward for t in ok]
        if self.settings.dynamic_sampling and len(ok) > 1 and min(rewards) == max(rewards):
            return Part(model, ZERO_VARIANCE, min_version, len(ok)), versions
        for name, keep in self.filters:
            if not keep(model, ok):
                return Part(model, f"filter:{name}", min_version, len(ok)), versions
        samples = SampleGroup(
            uid=group.uid,
            model=model,
            min_version=min_version,
            max_version=max_version,
            rollout=raw,
            indices=mine,
            advantages=advantages(np.array(rewards), self.settings.normalize, self.settings.epsilon),
            submitted_version=group.version,
            raas=group.raas,
        )
        return Part(model, "", min_version, len(ok), pack(samples)), versions

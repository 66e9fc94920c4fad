"""What the collector decides for one rollout group, per model: failed, filtered, zero variance, or
accepted with normalised advantages. Pure functions; the staleness check is the store's (it needs the
trainer version at the instant of the write)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

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
    return _resolve(name, FILTERS, "group filter")


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


class Judge:
    """Decides each model's part of a rollout group under the collector settings."""

    def __init__(self, settings: CollectorSettings, models: Sequence[str]) -> None:
        self.settings, self.models = settings, list(models)
        self.filters = [(name, resolve_filter(name)) for name in settings.filters]

    def __call__(self, entry_id: str, group: RolloutGroup) -> Collected:
        models = group.models or sorted({t.model for t in group.trajectories}) or self.models
        parts = [self._part(group, m) for m in models]
        first = [t.reward for t in group.trajectories if t.model == models[0] and t.error is None]
        versions = [int(v) for t in group.trajectories for v in t.versions[t.loss_mask.astype(bool)]]
        trace = {"raas": group.raas}
        if versions:
            trace["token_versions"] = f"{min(versions)}..{max(versions)}"
        if group.error:
            trace["error"] = group.error[:500]
        return Collected(
            entry_id=entry_id,
            uid=group.uid,
            parts=parts,
            mean_reward=float(np.mean(first)) if first else None,
            zero_variance=len(first) > 1 and float(np.ptp(first)) == 0.0,
            trace=trace,
        )

    def _part(self, group: RolloutGroup, model: str) -> Part:
        ok = [t for t in group.trajectories if t.model == model and t.error is None]
        trained = [t.versions[t.loss_mask.astype(bool)] for t in ok]
        if group.error or not ok or not any(len(v) for v in trained):
            return Part(model, FAILED, 0, len(ok))
        min_version = int(min(v.min() for v in trained if len(v)))
        max_version = int(max(v.max() for v in trained if len(v)))
        rewards = np.array([t.reward for t in ok])
        if self.settings.dynamic_sampling and len(ok) > 1 and float(np.ptp(rewards)) == 0.0:
            return Part(model, ZERO_VARIANCE, min_version, len(ok))
        for name, keep in self.filters:
            if not keep(model, ok):
                return Part(model, f"filter:{name}", min_version, len(ok))
        samples = SampleGroup(
            uid=group.uid,
            model=model,
            min_version=min_version,
            max_version=max_version,
            trajectories=ok,
            advantages=advantages(rewards, self.settings.normalize, self.settings.epsilon),
            submitted_version=group.version,
            raas=group.raas,
        )
        return Part(model, "", min_version, len(ok), pack(samples))

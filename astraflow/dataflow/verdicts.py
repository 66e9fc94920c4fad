"""What the collector decides for one rollout group, per model: failed, filtered, zero variance, or
accepted with normalised advantages. Pure functions; the staleness check is the store's (it needs the
trainer version at the instant of the write)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np

from astraflow.dataflow.settings import CollectorSettings
from astraflow.dataflow.store import Collected, Part
from astraflow.decoding import column, joined
from astraflow.errors import DecodeError
from astraflow.messages import RolloutGroup, SampleGroup, Trajectory, pack
from astraflow.streams.schema import Trace
from astraflow.workflows.api import _resolve

GroupFilter = Callable[[str, Sequence[Trajectory]], bool]
"""`(model, trajectories) -> keep`: a user filter of accepted groups, registered by name."""
FILTERS: dict[str, GroupFilter] = {}

# Drop reasons counted in the ledger (plus `stale_ingest`/`stale_wait` from the scripts, `filter:<name>`).
FAILED, ZERO_VARIANCE = "failed", "zero_variance"


VERSIONS_AHEAD = 1000
"""How far a trained token's weight version may be ahead of the newest version recorded for its policy.
A RaaS loads only announced versions, so a token is ahead of the record only after a rollback (a restarted
trainer announces its checkpoint's older version: fewer than `trainer.checkpoint_every` back) or while a
read of the record races a newer one; this allows every such case and refuses what no run produces (a
forged or corrupted version such as 2**31 - 1)."""
LOGPROB_SLACK = 1e-3
"""A sampled token's logprob is <= 0; an engine's log-softmax may round its top token a hair above."""


class InvalidRollout(DecodeError):
    """A rollout with values no trainer may take: not finite, or out of their range."""


def vocab_size(model_path: str) -> int | None:
    """`vocab_size` of the `config.json` in the local directory `model_path`; None when there is none (a
    hub id, an `openai` engine's served name): nothing is downloaded."""
    config = Path(model_path) / "config.json"
    if not config.is_file():
        return None
    size = json.loads(config.read_text()).get("vocab_size")
    return size if isinstance(size, int) and size > 0 else None


Owned = Mapping[str, tuple[list[int], tuple[int, int] | None]]
"""Per policy of a checked group, in the group's order: the indices of its trajectories that did not fail
and the (oldest, newest) weight version of their trained tokens (None: they have none)."""


def check_values(group: RolloutGroup, newest: Mapping[str, int], vocab: Mapping[str, int]) -> Owned:
    """Raise InvalidRollout unless every trajectory that did not fail has a finite reward and metrics,
    finite logprobs <= 0, token ids in its policy's vocabulary (`vocab`, where known), and versions of
    its trained tokens >= 0 and at most VERSIONS_AHEAD past its policy's `newest` version (where known);
    returns what the verdict reads of them (`Owned`).

    The group is read a column at a time (a few reductions per policy, not per trajectory); only a
    group that fails is looked at trajectory by trajectory, to say which one."""
    trajs = group.trajectories
    models, rewards, metrics = column(trajs, "model"), column(trajs, "reward"), column(trajs, "metrics")
    ok = [i for i, error in enumerate(column(trajs, "error")) if error is None]
    for i in ok:
        if not math.isfinite(rewards[i]):
            raise InvalidRollout(f"trajectory {i} ({models[i]}): reward {rewards[i]} is not finite")
        bad = [k for k, v in metrics[i].items() if not math.isfinite(v)]
        if bad:
            raise InvalidRollout(f"trajectory {i} ({models[i]}): metric {bad[0]!r} is not finite")
    owned = {}
    for model in dict.fromkeys(models[i] for i in ok):  # in order: the first bad trajectory is named
        mine = [i for i in ok if models[i] == model]
        limits = (newest.get(model), vocab.get(model))
        passed, versions = _arrays_ok(trajs, mine, *limits)
        if not passed:
            for i in mine:
                if len(trajs[i].token_ids):
                    _check_arrays(f"trajectory {i} ({model})", trajs[i], *limits)
        owned[model] = (mine, versions)
    return owned


def _arrays_ok(
    trajectories: Sequence[Trajectory], picked: list[int], top: int | None, n: int | None
) -> tuple[bool, tuple[int, int] | None]:
    """Whether the arrays of the `picked` trajectories (one policy's) pass `_check_arrays`, at once, and
    the (oldest, newest) version of their trained tokens (None: none)."""
    logprobs = joined(trajectories, "logprobs", picked)
    if not len(logprobs):
        return True, None
    trained = _trained_versions(trajectories, picked)
    versions = (int(trained.min()), int(trained.max())) if len(trained) else None
    # (A NaN fails both comparisons: a reduction over an array holding one is NaN.)
    if not (logprobs.min() > -math.inf and logprobs.max() <= LOGPROB_SLACK):
        return False, versions
    ids = joined(trajectories, "token_ids", picked)
    if ids.min() < 0 or (n is not None and ids.max() >= n):
        return False, versions
    if versions and (versions[0] < 0 or (top is not None and versions[1] > top + VERSIONS_AHEAD)):
        return False, versions
    return True, versions


def _check_arrays(where: str, t: Trajectory, top: int | None, n: int | None) -> None:
    if not np.isfinite(t.logprobs).all():
        raise InvalidRollout(f"{where}: logprobs are not finite")
    if t.logprobs.max() > LOGPROB_SLACK:
        raise InvalidRollout(f"{where}: logprob {float(t.logprobs.max())} > 0")
    low, high = int(t.token_ids.min()), int(t.token_ids.max())
    if low < 0 or (n is not None and high >= n):
        token = low if low < 0 else high
        raise InvalidRollout(f"{where}: token id {token} outside the vocabulary [0, {n or 'inf'})")
    trained = t.versions[t.loss_mask != 0]
    if len(trained) == 0:
        return
    if int(trained.min()) < 0:
        raise InvalidRollout(f"{where}: token version {int(trained.min())} < 0 on a trained token")
    if top is not None and int(trained.max()) > top + VERSIONS_AHEAD:
        raise InvalidRollout(
            f"{where}: token version {int(trained.max())} > newest version {top} + {VERSIONS_AHEAD}"
        )


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


def _trained_versions(trajectories: Sequence[Trajectory], picked: list[int]) -> np.ndarray:
    """The weight versions of the trained tokens (loss mask set) of the `picked` trajectories."""
    return joined(trajectories, "versions", picked)[joined(trajectories, "loss_mask", picked) != 0]


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

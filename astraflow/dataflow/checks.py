"""The collector's checks of a rollout group's values before anything of it is trusted: rewards within
the recipe's `collector.reward_range`, metrics finite with names of METRIC_NAME (at most MAX_METRIC_NAMES),
logprobs in [LOGPROB_FLOOR, 0], token ids in the vocabulary, weight versions in range. A value from a RaaS
is data until checked here; a group that fails is dead-lettered with the reason. A group that passes
cannot make a training step non-finite (the loss bounds the log-ratio it takes from these logprobs, see
`trainer.losses`), so the trainer never sets legitimate groups aside because one of them was hostile.

The groups of one read are checked together where they can be (`check_groups`): a few numpy reductions
per read, not per group; only a read that fails is looked at group by group, to say which one.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from astraflow.columnar import ColumnList, column, joined
from astraflow.errors import DecodeError
from astraflow.messages import RolloutGroup, Trajectory
from astraflow.streams.records import MAX_METRIC_NAMES, METRIC_NAME

VERSIONS_AHEAD = 1000
"""How far a trained token's weight version may be ahead of the newest version recorded for its policy.
A RaaS loads only announced versions, so a token is ahead of the record only after a rollback (a restarted
trainer announces its checkpoint's older version: fewer than `trainer.checkpoint_every` back) or while a
read of the record races a newer one; this allows every such case and refuses what no run produces (a
forged or corrupted version such as 2**31 - 1)."""
LOGPROB_SLACK = 1e-3
"""A sampled token's logprob is <= 0; an engine's log-softmax may round its top token a hair above."""
LOGPROB_FLOOR = -1e4
"""The lowest logprob a token may carry. A sampled token's is far above it (one of probability e^-100 is
never drawn; vLLM's server reports -9999.0 where a logprob is -inf, still above), so only a forged or
corrupted value is below, such as -1e30, which made a step's loss infinite and its whole batch set
aside."""
SAMPLING = ("temperature", "top_k", "top_p")
"""A trajectory's fields that say how its logprobs were sampled (`_sampling_problem`)."""
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-3, 100.0
"""The sampling temperatures a trajectory may say it was drawn at, besides 0 (greedy). The trainer divides
the logits by it (`astraflow.logits`): a forged 1e-30 or 1e30 would make every logprob of the group
extreme."""
DEFAULT_REWARD_RANGE = (-1.0, 1.0)
"""What `check_values` allows when not told (the shipped rewards all give 0 to 1)."""


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


def check_values(
    group: RolloutGroup,
    newest: Mapping[str, int],
    vocab: Mapping[str, int],
    rewards_in: tuple[float, float] = DEFAULT_REWARD_RANGE,
) -> Owned:
    """Raise InvalidRollout unless every trajectory that did not fail has a reward in `rewards_in` (the
    recipe's `collector.reward_range`), sampling settings an engine uses (`_sampling_problem`), finite
    metrics named by METRIC_NAME (at most MAX_METRIC_NAMES), logprobs in [LOGPROB_FLOOR, 0], token ids in
    its policy's vocabulary (`vocab`, where known), and versions of its trained tokens >= 0 and at most
    VERSIONS_AHEAD past its policy's `newest` version (where known); returns what the verdict reads of
    them (`Owned`).

    The group is read a column at a time (a few reductions per policy, not per trajectory); only a
    group that fails is looked at trajectory by trajectory, to say which one."""
    trajs = group.trajectories
    models, rewards, metrics = column(trajs, "model"), column(trajs, "reward"), column(trajs, "metrics")
    ok = [i for i, error in enumerate(column(trajs, "error")) if error is None]
    low, high = rewards_in
    sampling = [column(trajs, name) for name in SAMPLING]
    for i in ok:
        if not math.isfinite(rewards[i]):
            raise InvalidRollout(f"trajectory {i} ({models[i]}): reward {rewards[i]} is not finite")
        if not low <= rewards[i] <= high:
            raise InvalidRollout(
                f"trajectory {i} ({models[i]}): reward {rewards[i]} outside the recipe's"
                f" collector.reward_range [{low:g}, {high:g}]"
            )
        problem = _metrics_problem(metrics[i]) or _sampling_problem(*(c[i] for c in sampling))
        if problem:
            raise InvalidRollout(f"trajectory {i} ({models[i]}): {problem}")
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


def _sampling_problem(t: float, k: int, p: float) -> str:
    """What is wrong with the sampling (temperature, top-k, top-p) a trajectory says its logprobs are of
    ('' when nothing): the trainer scores its tokens through the same processing, so each value must be one
    an engine samples with."""
    if not (t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE):
        return f"temperature {t} outside 0 or [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]"
    if not 0 <= k < 2**31:
        return f"top_k {k} outside [0, 2**31)"
    if not 0 <= p <= 1:
        return f"top_p {p} outside [0, 1]"
    return ""


def _metrics_problem(metrics: Mapping[str, float]) -> str:
    """What is wrong with a trajectory's workflow metrics ('' when nothing): too many, a name that is not
    METRIC_NAME's (control characters would reach the status line, TensorBoard tags, metrics.jsonl), or
    a value that is not finite."""
    if len(metrics) > MAX_METRIC_NAMES:
        return f"{len(metrics)} metrics (at most {MAX_METRIC_NAMES})"
    for name, value in metrics.items():
        if not isinstance(name, str) or not METRIC_NAME.fullmatch(name):
            return f"metric name {str(name)[:40]!r} is not {METRIC_NAME.pattern}"
        if not math.isfinite(value):
            return f"metric {name!r} is not finite"
    return ""


def check_groups(
    groups: Sequence[RolloutGroup],
    newest: Mapping[str, int],
    vocab: Mapping[str, int],
    rewards_in: tuple[float, float] = DEFAULT_REWARD_RANGE,
) -> list[Owned | Exception]:
    """`check_values` of each of `groups`: what it returns, or what it raised. Groups whose trajectories
    all belong to one policy and none failed (the usual read) are checked together, per policy: one
    concatenation and a few reductions for the lot. When any of them fails, each is checked on its own."""
    out: list[Owned | Exception | None] = [None] * len(groups)
    together: dict[str, list[int]] = {}
    for i, g in enumerate(groups):
        if (model := _one_policy(g)) is not None:
            together.setdefault(model, []).append(i)
    for model, picked in together.items():
        picked_groups = [groups[i] for i in picked]
        ranges = _versions_at_once(picked_groups, newest.get(model), vocab.get(model), rewards_in)
        for i, versions in zip(picked, ranges or (), strict=False):
            out[i] = {model: (list(range(len(groups[i].trajectories))), versions)}
    for i, g in enumerate(groups):
        if out[i] is None:
            try:
                out[i] = check_values(g, newest, vocab, rewards_in)
            except Exception as e:  # (the caller dead-letters or releases the group by its kind)
                out[i] = e
    return out  # type: ignore[return-value]


def _one_policy(group: RolloutGroup) -> str | None:
    """The policy of every trajectory of `group`, when there is one and none failed (and each has
    tokens); else None."""
    trajs = group.trajectories
    if (
        not isinstance(trajs, ColumnList)
        or not len(trajs)
        or any(e is not None for e in column(trajs, "error"))
    ):
        return None
    models = set(column(trajs, "model"))
    if len(models) != 1 or not len(joined(trajs, "logprobs")):
        return None
    return models.pop()


_NONE = np.iinfo(np.int64).max


def _versions_at_once(
    groups: Sequence[RolloutGroup], top: int | None, n: int | None, rewards_in: tuple[float, float]
) -> list[tuple[int, int] | None] | None:
    """Per group (all of one policy, none failed, each with tokens), the (oldest, newest) version of its
    trained tokens (None: none) if every value passes `check_values`; None if any does not."""
    cols = [g.trajectories.columns for g in groups]  # type: ignore[attr-defined]
    rewards = np.asarray([r for c in cols for r in c["reward"]], dtype=np.float64)
    if not (rewards.min() >= rewards_in[0] and rewards.max() <= rewards_in[1]):  # (NaN fails both)
        return None
    if any(_metrics_problem(m) for c in cols for m in c["metrics"] if m):
        return None
    t, k, p = (np.asarray([x for c in cols for x in c[name]], np.float64) for name in SAMPLING)
    t_ok = (t == 0) | ((t >= MIN_TEMPERATURE) & (t <= MAX_TEMPERATURE))
    if not (t_ok.all() and k.min() >= 0 and k.max() < 2**31 and p.min() >= 0 and p.max() <= 1):
        return None
    logprobs = np.concatenate([c["logprobs"] for c in cols])
    if not (logprobs.min() >= LOGPROB_FLOOR and logprobs.max() <= LOGPROB_SLACK):  # (NaN fails both)
        return None
    ids = np.concatenate([c["token_ids"] for c in cols])
    if ids.min() < 0 or (n is not None and ids.max() >= n):
        return None
    versions = np.concatenate([c["versions"] for c in cols]).astype(np.int64)
    trained = np.concatenate([c["loss_mask"] for c in cols]) != 0
    starts = np.cumsum([0] + [len(c["logprobs"]) for c in cols[:-1]])
    lows = np.minimum.reduceat(np.where(trained, versions, _NONE), starts).tolist()
    highs = np.maximum.reduceat(np.where(trained, versions, -_NONE), starts).tolist()
    ranges = [None if low == _NONE else (low, high) for low, high in zip(lows, highs, strict=True)]
    found = [r for r in ranges if r is not None]
    if found and (
        min(r[0] for r in found) < 0 or (top is not None and max(r[1] for r in found) > top + VERSIONS_AHEAD)
    ):
        return None
    return ranges


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
    if not (logprobs.min() >= LOGPROB_FLOOR and logprobs.max() <= LOGPROB_SLACK):
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
    if t.logprobs.min() < LOGPROB_FLOOR:
        raise InvalidRollout(f"{where}: logprob {float(t.logprobs.min()):g} < the floor {LOGPROB_FLOOR:g}")
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


def _trained_versions(trajectories: Sequence[Trajectory], picked: list[int]) -> np.ndarray:
    """The weight versions of the trained tokens (loss mask set) of the `picked` trajectories."""
    return joined(trajectories, "versions", picked)[joined(trajectories, "loss_mask", picked) != 0]

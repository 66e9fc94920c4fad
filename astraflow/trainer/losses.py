"""The policy losses on [batch, tokens] tensors: PPO-clip and the off-policy corrections, each as its paper
defines it, one function per correction registered by name (`CORRECTIONS`, `loss.correction`).

    logp   log pi_theta(token), with grad            behav  logprob the engine sampled with
    prox   logprob of the weights before this update, recomputed by the trainer (no grad; optional)
    ref    logprob of the frozen reference (no grad; optional)
    adv    advantage per token (its sequence's)      mask   1 where the token is trained on

All are scored through the sampling the engine used (temperature, top-k, top-p: `trainer.batching`), so
at the same weights logp = behav up to the engines' numerics. w = exp(prox - behav) is the trainer's
probability at the weights before this update over the engine's at sampling: engine/trainer mismatch
alone on a fresh sample, mismatch and policy drift on a stale one.

A correction says, per token, what the ratio r = exp(logp - base) is taken against, a detached weight,
which tokens it keeps and whether r is clipped. Then, per token: surrogate max(-A r, -A clip(r, 1 -
clip_low, 1 + clip_high)) (capped at c |A| for A < 0 with dual clip), or -A r unclipped; times the weight;
plus the KL penalty to the reference (k1 = logp - ref, k2 = (logp - ref)^2 / 2, k3 = e^(ref-logp) -
(ref-logp) - 1). Aggregation: mean over trained tokens, or mean over sequences of each sequence's token
mean; dropped tokens count in the denominator (they contribute zero), so dropping never inflates the
others. Ratio per token, or one per sequence (the geometric mean of its tokens'); its log is clamped at
LOG_RATIO_MAX.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch

from astraflow.trainer.settings import LossSettings

LOG_RATIO_MAX = 20.0
"""The log of the largest importance ratio taken (verl clamps at the same place). The collector lets a
sampled logprob down to -1e4 (`dataflow.checks.LOGPROB_FLOOR`); exp of that far a log-ratio overflows to
inf, which made the loss or its gradient non-finite and the trainer set the whole batch aside. A ratio of
e^20 is clipped by the surrogate anyway, and the token gets no gradient past it."""


def behaviour_weight(prox: torch.Tensor, behav: torch.Tensor) -> torch.Tensor:
    """w = pi_prox / pi_behav, detached, its log clamped at LOG_RATIO_MAX: a logprob at the collector's floor
    gives a large but finite weight (exp of the plain difference is inf, and inf times a dropped token's 0
    is NaN)."""
    return torch.exp((prox - behav).clamp(max=LOG_RATIO_MAX)).detach()


@dataclass(frozen=True)
class Terms:
    """What a correction makes of one micro-batch's tokens."""

    base: torch.Tensor
    """The logprobs the ratio is taken against."""
    weight: torch.Tensor | None = None
    """Per-token factor of the surrogate (detached); None = 1."""
    keep: torch.Tensor | None = None
    """1 where the token is kept, 0 where dropped; None = all kept."""
    clip: bool = True
    """PPO's clip of the ratio (M2PO replaces it by its mask)."""


Correction = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, LossSettings], Terms]
CORRECTIONS: dict[str, Correction] = {}
"""name -> fn(behav, prox, mask, settings), each name a value of `loss.correction` (the settings' `Literal`;
`tests/unit/test_registries.py` fails when the two differ)."""
WITHOUT_PROX: set[str] = set()
"""The corrections that never read `prox` (it is None for them: the trainer does not compute it)."""


def correction(name: str, reads_prox: bool = True) -> Callable[[Correction], Correction]:
    """Register a correction under `name` (a value of `loss.correction`); `reads_prox`: whether it reads
    the proximal logprobs, which the trainer then recomputes before each update."""

    def register(fn: Correction) -> Correction:
        CORRECTIONS[name] = fn
        if not reads_prox:
            WITHOUT_PROX.add(name)
        return fn

    return register


def needs_prox(cfg: LossSettings) -> bool:
    """Whether the loss of `cfg` reads the proximal (trainer) logprobs."""
    return cfg.correction not in WITHOUT_PROX


@correction("none", reads_prox=False)
def ppo(behav, prox, mask, cfg: LossSettings) -> Terms:
    """PPO-clip (Schulman et al. 2017, arXiv 1707.06347) on the ratio to the behaviour logprobs, no
    correction: the engine's probabilities stand in for pi_old. Gradient -A r grad log pi inside the clip."""
    return Terms(base=behav)


@correction("decoupled")
def decoupled(behav, prox, mask, cfg: LossSettings) -> Terms:
    """Decoupled PPO (Fu et al., "AReaL", arXiv 2505.24298, eq. 5): the ratio to the proximal policy (the
    weights before this update), clipped; each token weighted by the behaviour importance weight w =
    pi_prox / pi_behav. With `decoupled_cap`: `drop` gives tokens with w above it weight 0 (AReaL's
    `behav_imp_weight_cap`), `clamp` weights them min(w, cap). Gradient -A w r_prox grad log pi inside the
    clip (on a step's first minibatch r_prox = 1)."""
    w = behaviour_weight(prox, behav)
    cap = cfg.decoupled_cap
    if cap is None:
        return Terms(base=prox, weight=w)
    if cfg.decoupled_cap_mode == "clamp":
        return Terms(base=prox, weight=w.clamp(max=cap))
    return Terms(base=prox, weight=w, keep=(w <= cap).to(w.dtype))


@correction("tis")
def tis(behav, prox, mask, cfg: LossSettings) -> Terms:
    """Truncated importance sampling (Yao et al. 2025, "Your efficient RL framework secretly brings you
    off-policy RL training"): PPO-clip on the trainer's own ratio pi_theta / pi_prox, weighted once by the
    truncated engine/trainer weight min(pi_prox / pi_behav, tis_cap) (the paper's C = 2). On a fresh sample
    w is the mismatch between the engines at the same weights, as in the paper; on a stale one it also
    carries the drift since sampling, and TIS is then decoupled PPO with a clamped cap."""
    w = behaviour_weight(prox, behav)
    return Terms(base=prox, weight=w.clamp(max=cfg.tis_cap))


@correction("icepop")
def icepop(behav, prox, mask, cfg: LossSettings) -> Terms:
    """IcePop (Ling team, "Small Leak Can Sink a Great Ship - Boost RL Training on MoE with IcePop!", 2025;
    the Ring-1T report): PPO-clip on the trainer's ratio pi_theta / pi_prox, weighted by
    M(w) = w where alpha <= w <= beta, else 0 (the token is masked), w = pi_prox / pi_behav the
    training/inference ratio; alpha = `icepop_low` (0.5), beta = `icepop_high` (5)."""
    w = behaviour_weight(prox, behav)
    keep = ((w >= cfg.icepop_low) & (w <= cfg.icepop_high)).to(w.dtype)
    return Terms(base=prox, weight=w, keep=keep)


@correction("m2po")
def m2po(behav, prox, mask, cfg: LossSettings) -> Terms:
    """M2PO (Zheng et al. 2025, "Prosperity before Collapse: How Far Can Off-Policy RL Reach with Stale Data
    on LLMs?"; AReaL's `m2_threshold`): no clip; the ratio to the behaviour policy, and the tokens of largest
    second moment (log pi_theta / pi_behav)^2 masked until the mean over the rest is at most tau_M2
    (`m2po_threshold`, 0.04). The moment is taken at the weights before this update (prox), once per step.
    Gradient -A r grad log pi on the kept tokens."""
    keep = m2po_keep((prox - behav).detach() ** 2, mask, cfg.m2po_threshold)
    return Terms(base=behav, keep=keep, clip=False)


def policy_loss(
    logp: torch.Tensor,
    behav: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossSettings,
    prox: torch.Tensor | None = None,
    ref: torch.Tensor | None = None,
    denominator: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of one micro-batch and its statistics. `denominator`: trained tokens (token_mean) or
    sequences (sequence_mean) of the whole minibatch, so micro-batch losses add up to its mean."""
    mask = mask.to(logp.dtype)
    if prox is None and needs_prox(cfg):
        raise ValueError(f"correction {cfg.correction!r} needs the proximal (trainer) logprobs")
    terms = CORRECTIONS[cfg.correction](behav, prox, mask, cfg)
    log_ratio = logp - terms.base
    if cfg.ratio_level == "sequence":
        per_seq = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        log_ratio = per_seq.unsqueeze(-1).expand_as(logp)
    ratio = torch.exp(log_ratio.clamp(max=LOG_RATIO_MAX))
    surr = -adv * ratio
    loss, clipped = surr, torch.zeros_like(mask)
    if terms.clip:
        surr_clipped = -adv * ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
        loss, clipped = torch.maximum(surr, surr_clipped), (surr_clipped > surr).to(mask.dtype)
        if cfg.dual_clip is not None:
            loss = torch.where(adv < 0, torch.minimum(loss, -adv * cfg.dual_clip), loss)
    weight = terms.weight if terms.weight is not None else torch.ones_like(logp)
    keep = mask if terms.keep is None else mask * terms.keep
    loss = loss * weight
    kl = None
    if ref is not None and cfg.kl_coef > 0:
        kl = kl_estimate(logp, ref, cfg.kl_estimator)
        loss = loss + cfg.kl_coef * kl

    # where, not a product: a dropped token's unclipped ratio may overflow, and inf x 0 is nan
    total = aggregate(torch.where(keep > 0, loss, 0.0), mask, cfg.aggregation, denominator)
    n = mask.sum().clamp(min=1)
    kept_weight = weight * keep
    stats = {
        "clip_frac": float((clipped * mask).sum() / n),
        "ratio_mean": float((ratio.detach() * mask).sum() / n),
        "is_weight_mean": float(kept_weight.sum() / n),
        "is_weight_max": float(kept_weight.max()) if mask.any() else 0.0,
        "dropped_frac": float((mask - keep).sum() / n),
    }
    if kl is not None:
        stats["kl"] = float((kl.detach() * mask).sum() / n)
    return total, stats


def token_mean(values: torch.Tensor, mask: torch.Tensor, denominator: float | None) -> torch.Tensor:
    """Sum of the masked values over trained tokens, divided by `denominator` (default: this batch's
    trained tokens)."""
    return (values * mask).sum() / (denominator or mask.sum().clamp(min=1))


def sequence_mean(values: torch.Tensor, mask: torch.Tensor, denominator: float | None) -> torch.Tensor:
    """Sum of the per-sequence token means, divided by `denominator` (default: this batch's sequences with
    a trained token)."""
    per_seq = (values * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return per_seq.sum() / (denominator or max(int((mask.sum(-1) > 0).sum()), 1))


@dataclass(frozen=True)
class Aggregation:
    reduce: Callable[[torch.Tensor, torch.Tensor, float | None], torch.Tensor]
    """fn(values, mask, denominator): the loss of a micro-batch."""
    units: Callable[[np.ndarray], int]
    """What one sample counts in the denominator, from its trained-token mask (tokens, or 1 sequence)."""


AGGREGATIONS = {
    "token_mean": Aggregation(token_mean, lambda mask: int(mask.sum())),
    "sequence_mean": Aggregation(sequence_mean, lambda mask: int(mask.any())),
}
"""`loss.aggregation` -> how micro-batch losses add up to a minibatch's mean."""


def _aggregation(how: str) -> Aggregation:
    try:
        return AGGREGATIONS[how]
    except KeyError:
        raise ValueError(f"unknown aggregation: {how!r}") from None


def aggregate(values: torch.Tensor, mask: torch.Tensor, how: str, denominator: float | None) -> torch.Tensor:
    """The loss of masked `values` aggregated as `how` (a key of AGGREGATIONS)."""
    return _aggregation(how).reduce(values, mask, denominator)


def denominator(cfg: LossSettings, masks: Iterable[np.ndarray]) -> int:
    """The units (tokens or sequences, by `cfg.aggregation`) that samples with trained-token `masks` count:
    a minibatch's, so its micro-batch losses add up to its mean."""
    units = _aggregation(cfg.aggregation).units
    return sum(units(mask) for mask in masks)


def m2po_keep(sq: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """1 for tokens kept: the largest squared log-ratios are dropped until the mean of the rest (over the
    masked tokens) is at most `threshold`."""
    flat = sq[mask > 0]
    keep = torch.ones_like(sq)
    if flat.numel() == 0 or flat.mean() <= threshold:
        return keep
    ordered, _ = flat.sort(descending=True)
    remaining = ordered.flip(0).cumsum(0).flip(0)  # sum of the k-th largest and all smaller ones
    counts = torch.arange(len(ordered), 0, -1, dtype=sq.dtype, device=sq.device)
    means = remaining / counts  # mean after dropping the k largest, k = 0, 1, ...
    ok = torch.nonzero(means <= threshold)
    k = int(ok[0]) if len(ok) else len(ordered)
    if k == 0:
        return keep
    cutoff = ordered[k - 1]
    drop = (sq >= cutoff) & (mask > 0)
    # Ties at the cutoff: drop only as many as needed, in order of position.
    excess = int(drop.sum()) - k
    if excess > 0:
        ties = torch.nonzero(((sq == cutoff) & (mask > 0)).flatten()).flatten()
        drop.view(-1)[ties[-excess:]] = False
    return keep * (~drop).to(sq.dtype)


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "k1": lambda d: -d,
    "k2": lambda d: 0.5 * d**2,
    "k3": lambda d: torch.exp(d) - d - 1,
}
"""`loss.kl_estimator` -> the per-token estimate of KL(pi_theta || pi_ref) from d = ref - logp."""


def kl_estimate(logp: torch.Tensor, ref: torch.Tensor, estimator: str) -> torch.Tensor:
    """The per-token KL penalty to the reference by `estimator` (a key of KL_ESTIMATORS)."""
    try:
        fn = KL_ESTIMATORS[estimator]
    except KeyError:
        raise ValueError(f"unknown KL estimator: {estimator!r}") from None
    return fn(ref - logp)

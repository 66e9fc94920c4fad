"""The PPO/GRPO policy-loss family on [batch, tokens] tensors.

    logp   log pi_theta(token), with grad            behav  logprob the engine sampled with
    prox   logprob of the weights before this update, recomputed by the trainer (no grad; optional)
    ref    logprob of the frozen reference (no grad; optional)
    adv    advantage per token (its sequence's)      mask   1 where the token is trained on

Per token: ratio r = exp(min(logp - base, LOG_RATIO_MAX)), base = prox for decoupled PPO else behav (or
one ratio per sequence, the geometric mean of its tokens'); surrogate max(-A r, -A clip(r, 1 - clip_low,
1 + clip_high)), capped at c |A| for A < 0 with dual clip. Off-policy corrections use w = exp(prox -
behav): decoupled PPO and TIS weight the token by min(w, is_cap); IcePop drops tokens with w outside
[icepop_low, icepop_high]; M2PO drops the tokens with the largest (prox - behav)^2 until the mean over
the rest is under the threshold. KL to the reference: k1 = logp - ref, k2 = (logp - ref)^2 / 2,
k3 = e^(ref-logp) - (ref-logp) - 1.
Aggregation: mean over trained tokens, or mean over sequences of each sequence's token mean; dropped
tokens count in the denominator (they contribute zero), so dropping never inflates the others.
"""

from __future__ import annotations

import torch

from astraflow.trainer.settings import LossSettings

LOG_RATIO_MAX = 20.0
"""The log of the largest importance ratio taken (verl clamps at the same place). The collector lets a
sampled logprob down to -1e4 (`dataflow.checks.LOGPROB_FLOOR`); exp of that far a log-ratio overflows to
inf, which made the loss or its gradient non-finite and the trainer set the whole batch aside. A ratio of
e^20 is clipped by the surrogate anyway, and the token gets no gradient past it."""


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
    needs_prox = cfg.decoupled or cfg.correction != "none" or cfg.m2po_threshold is not None
    if needs_prox and prox is None:
        raise ValueError("decoupled PPO, TIS, IcePop and M2PO need the proximal (trainer) logprobs")
    base = prox if cfg.decoupled else behav
    log_ratio = logp - base
    if cfg.ratio_level == "sequence":
        per_seq = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        log_ratio = per_seq.unsqueeze(-1).expand_as(logp)
    ratio = torch.exp(log_ratio.clamp(max=LOG_RATIO_MAX))
    surr = -adv * ratio
    surr_clipped = -adv * ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    loss = torch.maximum(surr, surr_clipped)
    if cfg.dual_clip is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -adv * cfg.dual_clip), loss)

    keep = mask.clone()
    weight = torch.ones_like(logp)
    if prox is not None:
        w = torch.exp(prox - behav).detach()
        if cfg.decoupled or cfg.correction == "tis":
            weight = w.clamp(max=cfg.is_cap)
        if cfg.correction == "icepop":
            keep = keep * ((w >= cfg.icepop_low) & (w <= cfg.icepop_high)).to(keep.dtype)
        if cfg.m2po_threshold is not None:
            keep = keep * m2po_keep((prox - behav).detach() ** 2, keep, cfg.m2po_threshold)
    loss = loss * weight
    kl = None
    if ref is not None and cfg.kl_coef > 0:
        kl = kl_estimate(logp, ref, cfg.kl_estimator)
        loss = loss + cfg.kl_coef * kl

    total = aggregate(loss * keep, mask, cfg.aggregation, denominator)
    n = mask.sum().clamp(min=1)
    stats = {
        "clip_frac": float(((surr_clipped > surr) * mask).sum() / n),
        "ratio_mean": float((ratio.detach() * mask).sum() / n),
        "is_weight_mean": float((weight * mask).sum() / n),
        "is_weight_max": float((weight * mask).max()) if mask.any() else 0.0,
        "dropped_frac": float(((mask - keep) * mask).sum() / n),
    }
    if kl is not None:
        stats["kl"] = float((kl.detach() * mask).sum() / n)
    return total, stats


def aggregate(values: torch.Tensor, mask: torch.Tensor, how: str, denominator: float | None) -> torch.Tensor:
    """Sum of the masked values over trained tokens (token_mean) or of the per-sequence token means
    (sequence_mean), divided by `denominator` (default: this batch's tokens or sequences)."""
    if how == "token_mean":
        return (values * mask).sum() / (denominator or mask.sum().clamp(min=1))
    if how == "sequence_mean":
        per_seq = (values * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        return per_seq.sum() / (denominator or max(int((mask.sum(-1) > 0).sum()), 1))
    raise ValueError(f"unknown aggregation: {how!r}")


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


def kl_estimate(logp: torch.Tensor, ref: torch.Tensor, estimator: str) -> torch.Tensor:
    d = ref - logp
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d**2
    if estimator == "k3":
        return torch.exp(d) - d - 1
    raise ValueError(f"unknown KL estimator: {estimator!r}")

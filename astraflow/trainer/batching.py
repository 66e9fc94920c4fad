"""From a Batch of sample groups to padded micro-batches, bucketed by length.

Sequences are sorted by length and packed greedily into micro-batches of at most `max_tokens` padded
tokens, so little compute goes to padding without needing attention kernels that understand packed
sequences (the CPU path uses plain SDPA). Position t of the tensors is the prediction of token t + 1:
`targets`, `behav` (the engine's logprob of that token) and `mask` are shifted by one.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from astraflow.logits import cut_width, kept
from astraflow.messages import Batch
from astraflow.trainer.prefix import (
    Counted,
    SharedMicroBatch,
    sampling_rows,
    shared_logits,
    shared_micro_batches,
)


@dataclass(frozen=True)
class Sample:
    tokens: np.ndarray
    behav: np.ndarray
    mask: np.ndarray
    advantage: float
    version_lag: int
    """Version of the weights trained (default: the one the batch was formed for) minus the oldest version
    among the sample's group's tokens."""
    temperature: float = 1.0
    """The sampling `behav` is of (the trajectory's): the trainer's logprobs go through the same."""
    top_k: int = 0
    top_p: float = 1.0


@dataclass
class MicroBatch(Counted):
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    targets: torch.Tensor
    behav: torch.Tensor
    mask: torch.Tensor
    adv: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor


def samples(batch: Batch, version: int | None = None) -> list[Sample]:
    """The batch's samples; their lag counts from `version` (default the batch's)."""
    out = []
    for group in batch.groups:
        lag = (batch.version if version is None else version) - group.min_version
        for traj, adv in zip(group.trajectories, group.advantages, strict=True):
            out.append(
                Sample(
                    traj.token_ids,
                    traj.logprobs,
                    traj.loss_mask,
                    float(adv),
                    lag,
                    traj.temperature,
                    traj.top_k,
                    traj.top_p,
                )
            )
    return out


def split(items: list[Sample], parts: int) -> list[list[Sample]]:
    """`items` in `parts` nearly equal consecutive runs (fewer when there are fewer items)."""
    parts = max(1, min(parts, len(items)))
    bounds = np.linspace(0, len(items), parts + 1).round().astype(int)
    return [items[a:b] for a, b in itertools.pairwise(bounds)]


def micro_batches(
    items: list[Sample], max_tokens: int, pad_id: int = 0, share_prefix: bool = False
) -> list[MicroBatch] | list[SharedMicroBatch]:
    """With `share_prefix`, samples with the same prompt share its forward (see `trainer.prefix`)."""
    if share_prefix:
        shared = shared_micro_batches(items, max_tokens, pad_id)
        if shared is not None:
            return shared
    ordered = sorted(items, key=lambda s: len(s.tokens), reverse=True)
    groups: list[list[Sample]] = []
    for s in ordered:
        if groups and (len(groups[-1]) + 1) * len(groups[-1][0].tokens) <= max_tokens:
            groups[-1].append(s)
        else:
            groups.append([s])
    return [collate(g, pad_id) for g in groups]


def collate(items: list[Sample], pad_id: int = 0) -> MicroBatch:
    width = max(len(s.tokens) for s in items)
    ids = np.full((len(items), width), pad_id, np.int64)
    attn = np.zeros((len(items), width), np.int64)
    behav = np.zeros((len(items), width), np.float32)
    mask = np.zeros((len(items), width), np.float32)
    adv = np.zeros((len(items), width), np.float32)
    for i, s in enumerate(items):
        n = len(s.tokens)
        ids[i, :n], attn[i, :n] = s.tokens, 1
        behav[i, :n], mask[i, :n], adv[i, :n] = s.behav, s.mask, s.advantage
    t = torch.from_numpy
    return MicroBatch(
        input_ids=t(ids),
        attention_mask=t(attn),
        targets=t(ids[:, 1:].copy()),
        behav=t(behav[:, 1:].copy()),
        mask=t(mask[:, 1:].copy()),
        adv=t(adv[:, 1:].copy()),
        **sampling_rows(items),
    )


LOGPROB_CHUNK_ROWS = 512
"""Positions whose log-softmax is computed at once: the transient float32 memory of the logprobs is at
most about 2 x this x the vocabulary x 4 bytes (0.6 GB at a 151,936-token vocabulary), whatever the size
of the micro-batch; each chunk is still large enough to keep a GPU busy."""


def token_logprobs(model, mb: MicroBatch, with_entropy: bool = False, chunk_rows: int = LOGPROB_CHUNK_ROWS):
    """log pi(target) at every position under each row's sampling (its temperature, top-k and top-p: the
    distribution its engine sampled from, `astraflow.logits`), and (optionally) the entropy of each such
    distribution (detached); float32, computed `chunk_rows` positions at a time (see `target_logprobs`)."""
    rows = (mb.temperature, mb.top_k, mb.top_p)
    if isinstance(mb, SharedMicroBatch):
        parts, start = [], 0
        for logits in shared_logits(model, mb):  # the pieces of the targets' columns, in order
            end = start + logits.shape[1]
            parts.append(target_logprobs(logits, mb.targets[:, start:end], with_entropy, chunk_rows, rows))
            start = end
        logp = torch.cat([p for p, _ in parts], 1)
        return logp, torch.cat([e for _, e in parts], 1) if with_entropy else None
    logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
    # The last position predicts nothing; a dummy target there keeps `logits` a contiguous view (slicing
    # it off first would copy the whole tensor).
    targets = torch.nn.functional.pad(mb.targets, (0, 1))
    logp, entropy = target_logprobs(logits, targets, with_entropy, chunk_rows, rows)
    return logp[:, :-1], entropy[:, :-1] if with_entropy else None


def target_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    with_entropy: bool = False,
    chunk_rows: int = LOGPROB_CHUNK_ROWS,
    sampling: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits)[target] = logit[target] - logsumexp(logits) for `logits` [B, ..., V] in any dtype
    and `targets` [B, ...]: float32 [B, ...], with the value and gradient of `log_softmax(logits.float())
    .gather(targets)`. Only `chunk_rows` positions at a time are upcast, in the forward and the backward;
    what the backward keeps is `logits` itself (no copy) and one float per position. With `with_entropy`
    also the entropy of each distribution, detached.

    `sampling`: (temperature, top_k, top_p), [B] each: row b's logits are divided by its temperature and
    cut to its top-k and top-p (`logits.kept`), renormalised, as its engine sampled. The target always
    stays in the cut: at the sampling weights the engine drew it from inside; at others the trainer's
    own cut may leave it out, and its logprob is then taken over the cut and the target (finite, so a
    drifted token is weighted and clipped like any other rather than turning the loss infinite)."""
    vocab = logits.shape[-1]
    rows = None
    width = None
    if sampling is not None:
        temperature, top_k, top_p = sampling
        shape = targets.shape
        rows = tuple(
            x.to(logits.device).reshape(-1, *[1] * (len(shape) - 1)).expand(shape).reshape(-1)
            for x in (temperature.float(), top_k, top_p.float())
        )
        width = cut_width(top_k.tolist(), top_p.tolist(), vocab)
        if width is None and bool((temperature == 1).all()):
            rows = None  # plain sampling: the plain path
    logp, entropy = _TargetLogprob.apply(
        logits.reshape(-1, vocab), targets.reshape(-1), chunk_rows, with_entropy, rows, width
    )
    return logp.view(targets.shape), entropy.view(targets.shape) if with_entropy else None


class _TargetLogprob(torch.autograd.Function):
    """[N, V] logits, [N] targets -> [N] float32 logprobs and entropies (empty unless asked for); `rows`:
    [N] temperatures, top-k and top-p of each position (None: plain), `width` as `logits.kept` takes it."""

    @staticmethod
    def forward(ctx, logits, targets, chunk_rows: int, with_entropy: bool, rows, width):
        n = logits.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(logp)
        entropy = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=logits.device)
        for a in range(0, n, chunk_rows):
            b = min(a + chunk_rows, n)
            x = _processed(logits, targets, rows, width, a, b)
            lse[a:b] = torch.logsumexp(x, -1)
            logp[a:b] = x.gather(-1, targets[a:b, None]).squeeze(-1) - lse[a:b]
            if with_entropy:
                x -= lse[a:b, None]  # log p
                p = x.exp()
                entropy[a:b] = -(torch.xlogy(p, p) if rows is not None else p.mul_(x)).sum(-1)
        ctx.save_for_backward(logits, targets, lse)
        ctx.chunk_rows, ctx.rows, ctx.width = chunk_rows, rows, width
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        # d logp_i / d logit_ij = ([j == target_i] - softmax_ij) / T_i over the kept tokens (0 elsewhere),
        # one chunk of rows at a time.
        logits, targets, lse = ctx.saved_tensors
        rows = ctx.rows
        grad = torch.empty_like(logits)
        for a in range(0, logits.shape[0], ctx.chunk_rows):
            b = min(a + ctx.chunk_rows, logits.shape[0])
            g = grad_logp[a:b, None]
            if rows is not None:
                g = g / rows[0][a:b, None]
            x = _processed(logits, targets, rows, ctx.width, a, b)
            x.sub_(lse[a:b, None]).exp_().mul_(-g)
            grad[a:b] = x.scatter_add_(-1, targets[a:b, None], g)
        return grad, None, None, None, None, None


def _processed(logits, targets, rows, width, a: int, b: int) -> torch.Tensor:
    """Rows a..b of `logits` in float32 (a copy), divided by their temperatures and with the tokens their
    cuts remove (all but the target) at -inf; as they are where `rows` is None."""
    x = logits[a:b].to(torch.float32, copy=True)
    if rows is None:
        return x
    temperature, top_k, top_p = rows
    x.div_(temperature[a:b, None])
    if width is not None:
        keep = kept(x, top_k[a:b], top_p[a:b], width)
        keep.scatter_(1, targets[a:b, None], True)
        x.masked_fill_(~keep, -float("inf"))
    return x

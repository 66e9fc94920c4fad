"""Target logprobs straight from the last hidden states, never the whole micro-batch's logits.

A causal LM's forward ends in `lm_head`: [tokens, hidden] -> [tokens, vocabulary] logits. At the gsm8k
recipe's 16,384-token micro-batches and Qwen2.5's 151,936-token vocabulary those logits are 4.6 GiB in bf16,
and their gradient as much again, both alive from the loss's backward into the lm_head's: more than the
8 GiB a step may use beyond its 16 B per parameter. Here the model's own forward runs with its lm_head
answering, in place of logits, the logprobs of the targets: `HEAD_CHUNK_ROWS` positions at a time, each
chunk's logits recomputed in the backward (activation checkpointing), so at most one chunk's logits and
their gradient exist at once. The forward is the model's own call, so FSDP2's hooks on the root module
(which holds the lm_head) gather and reduce its parameters as for any forward; the lm_head's names and
parameters are untouched (its `forward` is swapped on the instance for the call only).
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils.checkpoint import checkpoint

from astraflow.logits import cut_width, kept

LOGPROB_CHUNK_ROWS = 512
"""Positions whose log-softmax is computed at once: the transient float32 memory of the logprobs is at
most about 2 x this x the vocabulary x 4 bytes (0.6 GB at a 151,936-token vocabulary), whatever the size
of the micro-batch; each chunk is still large enough to keep a GPU busy."""
HEAD_CHUNK_ROWS = 2048
"""Positions whose logits exist at once: 2048 x 151,936 x 2 B = 0.6 GiB in bf16 (and their gradient in the
backward), whatever the micro-batch's size."""


def logprobs(model, input_ids, attention_mask, targets, with_entropy: bool, logprob_rows: int, sampling=None):
    """(log pi(target) at every position [B, T] float32, entropies [B, T] detached or None) of `model` on
    the inputs; `targets` [B, T] (the last column a dummy: it predicts nothing); `sampling`: each row's
    (temperature, top_k, top_p), [B] each, or None. The value and gradient are those of
    `target_logprobs(model(...).logits, targets, sampling=sampling)`."""
    head = model.get_output_embeddings()
    rows = targets.reshape(-1)
    vocab = head.weight.shape[0]
    sampling, width = _plan(sampling, vocab)  # once per micro-batch, not once per chunk
    per_position = ()  # each row's sampling at each of its positions, flat as `rows`
    if sampling is not None:
        per_position = _per_position(sampling, targets.shape, targets.device)
    entropies: list[torch.Tensor] = []
    recording = [True]  # the backward recomputes each chunk: its entropy is not taken again

    def chunk(hidden: torch.Tensor, chunk_targets: torch.Tensor, *at: torch.Tensor) -> torch.Tensor:
        logits = torch.nn.functional.linear(hidden, head.weight, head.bias)
        entropy_too = with_entropy and recording[0]  # not again when the backward recomputes the chunk
        logp, entropy = _TargetLogprob.apply(
            logits, chunk_targets, logprob_rows, entropy_too, at or None, width
        )
        if entropy_too:
            entropies.append(entropy)
        return logp

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1])
        parts = []
        for a in range(0, flat.shape[0], HEAD_CHUNK_ROWS):
            b = min(a + HEAD_CHUNK_ROWS, flat.shape[0])
            args = (flat[a:b], rows[a:b], *(x[a:b] for x in per_position))
            if torch.is_grad_enabled():  # the chunk's logits are recomputed in the backward, not kept
                parts.append(checkpoint(chunk, *args, use_reentrant=False))
            else:
                parts.append(chunk(*args))
        recording[0] = False
        return torch.cat(parts).view(*hidden.shape[:-1], 1)

    with _forward_replaced(head, forward):
        logp = model(input_ids=input_ids, attention_mask=attention_mask).logits[..., 0]
    entropy = torch.cat(entropies).view(targets.shape) if with_entropy else None
    return logp, entropy


@contextlib.contextmanager
def _forward_replaced(module, forward):
    """`module(x)` calls `forward(x)` within the block (an instance attribute over the class's method)."""
    module.forward = forward
    try:
        yield
    finally:
        del module.forward


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
    sampling, width = _plan(sampling, vocab)
    rows = None if sampling is None else _per_position(sampling, targets.shape, logits.device)
    logp, entropy = _TargetLogprob.apply(
        logits.reshape(-1, vocab), targets.reshape(-1), chunk_rows, with_entropy, rows, width
    )
    return logp.view(targets.shape), entropy.view(targets.shape) if with_entropy else None


def _plan(sampling, vocab: int):
    """(`sampling`, or None where every row samples plainly at temperature 1, the cut width as
    `logits.kept` takes it) of the rows' [B] settings: the one read of them on the host."""
    if sampling is None:
        return None, None
    temperature, top_k, top_p = sampling
    width = cut_width(top_k.tolist(), top_p.tolist(), vocab)
    if width is None and bool((temperature == 1).all()):
        return None, None
    return sampling, width


def _per_position(sampling, shape, device) -> tuple[torch.Tensor, ...]:
    """Each row's (temperature, top_k, top_p) at each of its positions of `shape` [B, ...], flat."""
    temperature, top_k, top_p = sampling
    return tuple(
        x.to(device).reshape(-1, *[1] * (len(shape) - 1)).expand(shape).reshape(-1)
        for x in (temperature.float(), top_k, top_p.float())
    )


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

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

LOGPROB_CHUNK_ROWS = 512
"""Positions whose log-softmax is computed at once: the transient float32 memory of the logprobs is at
most about 2 x this x the vocabulary x 4 bytes (0.6 GB at a 151,936-token vocabulary), whatever the size
of the micro-batch; each chunk is still large enough to keep a GPU busy."""
HEAD_CHUNK_ROWS = 2048
"""Positions whose logits exist at once: 2048 x 151,936 x 2 B = 0.6 GiB in bf16 (and their gradient in the
backward), whatever the micro-batch's size."""


def logprobs(model, input_ids, attention_mask, targets, with_entropy: bool, logprob_rows: int):
    """(log pi(target) at every position [B, T] float32, entropies [B, T] detached or None) of `model` on
    the inputs; `targets` [B, T] (the last column a dummy: it predicts nothing). The value and gradient
    are those of `target_logprobs(model(...).logits, targets)`."""
    head = model.get_output_embeddings()
    rows = targets.reshape(-1)
    entropies: list[torch.Tensor] = []
    recording = [True]  # the backward recomputes each chunk: its entropy is not taken again

    def chunk(hidden: torch.Tensor, chunk_targets: torch.Tensor) -> torch.Tensor:
        logits = torch.nn.functional.linear(hidden, head.weight, head.bias)
        entropy_too = with_entropy and recording[0]  # not again when the backward recomputes the chunk
        logp, entropy = target_logprobs(logits, chunk_targets, entropy_too, logprob_rows)
        if entropy_too:
            entropies.append(entropy)
        return logp

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1])
        parts = []
        for a in range(0, flat.shape[0], HEAD_CHUNK_ROWS):
            b = min(a + HEAD_CHUNK_ROWS, flat.shape[0])
            if torch.is_grad_enabled():  # the chunk's logits are recomputed in the backward, not kept
                parts.append(checkpoint(chunk, flat[a:b], rows[a:b], use_reentrant=False))
            else:
                parts.append(chunk(flat[a:b], rows[a:b]))
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits)[target] = logit[target] - logsumexp(logits) for `logits` [..., V] in any dtype
    and `targets` [...]: float32 [...], with the value and gradient of `log_softmax(logits.float())
    .gather(targets)`. Only `chunk_rows` positions at a time are upcast, in the forward and the backward;
    what the backward keeps is `logits` itself (no copy) and one float per position. With `with_entropy`
    also the entropy of each distribution, detached."""
    vocab = logits.shape[-1]
    logp, entropy = _TargetLogprob.apply(
        logits.reshape(-1, vocab), targets.reshape(-1), chunk_rows, with_entropy
    )
    return logp.view(targets.shape), entropy.view(targets.shape) if with_entropy else None


class _TargetLogprob(torch.autograd.Function):
    """[N, V] logits, [N] targets -> [N] float32 logprobs and entropies (empty unless asked for)."""

    @staticmethod
    def forward(ctx, logits, targets, chunk_rows: int, with_entropy: bool):
        n = logits.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(logp)
        entropy = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=logits.device)
        for a in range(0, n, chunk_rows):
            b = min(a + chunk_rows, n)
            x = logits[a:b].to(torch.float32, copy=True)
            lse[a:b] = torch.logsumexp(x, -1)
            logp[a:b] = x.gather(-1, targets[a:b, None]).squeeze(-1) - lse[a:b]
            if with_entropy:
                x -= lse[a:b, None]  # log p
                entropy[a:b] = -x.exp().mul_(x).sum(-1)
        ctx.save_for_backward(logits, targets, lse)
        ctx.chunk_rows = chunk_rows
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        # d logp_i / d logit_ij = [j == target_i] - softmax_ij, one chunk of rows at a time.
        logits, targets, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for a in range(0, logits.shape[0], ctx.chunk_rows):
            b = min(a + ctx.chunk_rows, logits.shape[0])
            g = grad_logp[a:b, None]
            x = logits[a:b].to(torch.float32, copy=True)
            x.sub_(lse[a:b, None]).exp_().mul_(-g)
            grad[a:b] = x.scatter_add_(-1, targets[a:b, None], g)
        return grad, None, None, None

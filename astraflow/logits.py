"""How sampling processes next-token logits, in one place for the engine that samples and the trainer that
scores: divide by the temperature, then cut to the top-k, then to the top-p nucleus, each cut renormalised
(vLLM's order, and what its `processed_logprobs` report). A token's logprob is only comparable between the
two when both process alike: the hf engine's sampler and the trainer's logprobs both use `kept` (torch is
imported where it is used).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def kept(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, width: int) -> torch.Tensor:
    """[n, V] bool: the tokens each row's cuts keep, from its temperature-scaled logits (or their log-softmax)
    `x`. `top_k` [n] (0 or >= V: no cut), `top_p` [n] (1: no cut); every cut row keeps at most `width` tokens
    (its top-k; V when it cuts by top-p alone), so only that many are sorted. Ties with the k-th token stay;
    the most likely token always stays (also with top_p 0); rows without a cut keep every token."""
    import torch

    vocab = x.shape[1]
    k_cut = (top_k > 0) & (top_k < vocab)
    p_cut = top_p < 1.0
    top, order = x.topk(min(width, vocab), dim=-1)  # sorted, most likely first
    k = torch.where(k_cut, top_k, vocab).clamp(max=top.shape[1])
    in_k = top >= top.gather(1, k[:, None] - 1)
    probs = top.masked_fill(~in_k, -float("inf")).softmax(-1)  # the top-k, renormalised
    before = probs.cumsum(-1) - probs  # the mass of the more likely tokens
    in_p = (before < top_p[:, None]) | ~p_cut[:, None]
    in_p[:, 0] = True
    inside = torch.zeros_like(x, dtype=torch.bool).scatter_(1, order, in_k & in_p)
    return inside | ~(k_cut | p_cut)[:, None]


def cut_width(top_k: list[int], top_p: list[float], vocab: int | None = None) -> int | None:
    """How many tokens `kept` must sort for rows with these cuts: None when no row cuts, else the largest
    top-k of a cut row (`vocab`, or unbounded when not given, for a row that cuts by top-p alone)."""
    big = vocab if vocab is not None else 2**62
    cut = [k if k > 0 else big for k, p in zip(top_k, top_p, strict=True) if k > 0 or p < 1.0]
    return max(cut) if cut else None

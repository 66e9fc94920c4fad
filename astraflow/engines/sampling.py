"""Sampling of a batch of requests from their next-token logits, in tensor ops on the logits' device.

One row per request; no host copy of the logits and no loop over the rows or the vocabulary. A row's
token at step t depends only on its logits and one uniform number hashed from (its seed, t), so a seeded
request gives the same tokens alone or in any batch, on any device (the hash is integer arithmetic).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

from astraflow.engines.base import SamplingParams
from astraflow.logits import cut_width, kept

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, eq=False)
class Sampler:
    """How each row of a batch is sampled: by inverse CDF (one uniform number per row and step) over
    the distribution after the temperature, then the top-k and then the top-p cut, each renormalised
    (vLLM's order; `astraflow.logits`, which the trainer scores with too)."""

    temperature: torch.Tensor
    """[n] float; 1 for greedy rows (their logprobs are at temperature 1)."""
    greedy: torch.Tensor
    """[n] bool."""
    top_k: torch.Tensor
    """[n] long; 0 or the vocabulary size or more = no top-k cut."""
    top_p: torch.Tensor
    """[n] float; 1 = no top-p cut."""
    seed: torch.Tensor
    """[n] int64, 63 bits."""
    cut_width: int | None
    """None when no row is cut; else how many of the most likely tokens a cut row may keep (its top-k;
    unbounded when a row cuts by top-p alone): only that many are sorted."""

    @classmethod
    def of(cls, params: list[SamplingParams], device) -> Sampler:
        import torch

        seeds = [(p.seed if p.seed is not None else random.getrandbits(63)) & (2**63 - 1) for p in params]
        return cls(
            temperature=torch.tensor(
                [p.temperature if p.temperature > 0 else 1.0 for p in params], device=device
            ),
            greedy=torch.tensor([p.temperature <= 0 for p in params], device=device),
            top_k=torch.tensor([p.top_k for p in params], device=device),
            top_p=torch.tensor([p.top_p for p in params], device=device),
            seed=torch.tensor(seeds, dtype=torch.int64, device=device),
            cut_width=cut_width([p.top_k for p in params], [p.top_p for p in params]),
        )

    def __call__(self, logits, step: int):
        """[n, vocab] logits -> ([n] tokens, [n] logprob of each under the distribution sampled from)."""
        import torch

        logp = torch.log_softmax(logits.float() / self.temperature[:, None], dim=-1)
        if self.cut_width is not None:
            logp = self._cut(logp, min(self.cut_width, logp.shape[1]))
        cdf = logp.exp().double().cumsum(-1)  # float64: a 151,936-term sum keeps its small tokens
        target = (_uniform(self.seed, step) * cdf[:, -1])[:, None]
        drawn = torch.searchsorted(cdf, target).squeeze(1).clamp(max=logp.shape[1] - 1)
        tokens = torch.where(self.greedy, logp.argmax(-1), drawn)
        return tokens, logp.gather(1, tokens[:, None]).squeeze(1)

    def _cut(self, logp, width: int):
        """`logp` with the top-k, then top-p cuts of each row that has them (`logits.kept`), renormalised."""
        import torch

        keep = kept(logp, self.top_k, self.top_p, width)
        return torch.log_softmax(logp.masked_fill(~keep, -float("inf")), dim=-1)


def _uniform(seed, step: int):
    """[n] float64 in (0, 1): a 32-bit hash of (seed, step) per row, integer ops only (same on any device)."""
    import torch

    lo, hi = seed & 0xFFFFFFFF, seed >> 32
    h = _mix32(lo ^ _mix32(hi ^ _mix32(torch.full_like(seed, (step ^ 0x9E3779B9) & 0xFFFFFFFF))))
    return (h.double() + 0.5) / 2**32


def _mix32(x):
    """murmur3's finaliser on int64 tensors holding 32-bit values (products kept below 2**63)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def _mul32(x, c: int):
    """(x * c) mod 2**32 for x < 2**32, in two 16-bit halves of c so that no int64 product overflows."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & 0xFFFFFFFF

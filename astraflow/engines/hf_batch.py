"""One batch of the hf engine in tensors: a prefill that runs each distinct prompt once, and the rows'
progress (stops, limits) kept on the model's device.

A prompt group's n samples share their prompt: its forward runs once and its key/value cache is
expanded to the n rows (the trainer's `share_prefix` does the same for training), so a batch of G groups
prefills G prompts, not G x n. Each step reads back one bool (is any row still running); the tokens and
logprobs come to the host once, when the batch ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from astraflow.engines.base import GenerateRequest, GenerateResponse

if TYPE_CHECKING:
    import torch


class Prefill(NamedTuple):
    logits: torch.Tensor
    """[n, vocab]: every row's next-token logits."""
    past: Any
    """The key/value cache of every row."""
    mask: torch.Tensor
    """[n, width]: the attention mask (left padding)."""
    positions: torch.Tensor
    """[n, 1]: the position of each row's last prompt token."""
    prompts: int
    """How many distinct prompts ran."""


def prefill(model, prompts: list[list[int]], pad_id: int, device) -> Prefill:
    """Each distinct prompt's forward once (left-padded), expanded to the rows that share it."""
    import torch

    distinct: dict[tuple[int, ...], int] = {}
    row = [distinct.setdefault(tuple(p), len(distinct)) for p in prompts]
    width = max(map(len, distinct))
    ids = torch.full((len(distinct), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(distinct), width), dtype=torch.long)
    for i, p in enumerate(distinct):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=1,  # the prompt's other positions predict nothing we sample
    )
    logits, past = out.logits[:, -1, :], out.past_key_values
    if len(distinct) < len(prompts):
        index = torch.tensor(row, device=device)
        past.reorder_cache(index)  # index_select along the batch: one copy of the prompt per row
        logits, mask, positions = logits[index], mask[index], positions[index]
    return Prefill(logits, past, mask, positions[:, -1:], len(distinct))


@dataclass
class Progress:
    """Which rows still run: a row ends after a stop token (eos or its own) or at its token limit."""

    limits: torch.Tensor
    """[n] long: the most tokens each row may produce."""
    stops: torch.Tensor
    """[n, s] long: each row's stop tokens, padded with -1."""
    active: torch.Tensor
    """[n] bool."""
    lengths: torch.Tensor
    """[n] long: tokens each row produced so far."""
    tokens: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, requests: list[GenerateRequest], eos_ids: set[int], max_model_len: int, device) -> Progress:
        import torch

        limits = [min(r.params.max_new_tokens, max_model_len - len(r.prompt_ids)) for r in requests]
        stops = [sorted(eos_ids | set(r.params.stop_token_ids)) for r in requests]
        width = max(1, *map(len, stops))
        padded = [s + [-1] * (width - len(s)) for s in stops]
        limit = torch.tensor(limits, dtype=torch.long, device=device)
        return cls(
            limits=limit,
            stops=torch.tensor(padded, dtype=torch.long, device=device),
            active=limit > 0,
            lengths=torch.zeros_like(limit),
        )

    def running(self) -> bool:
        """Whether any row still runs: the step's one read of the device."""
        return bool(self.active.any())

    def add(self, tokens: torch.Tensor, logprobs: torch.Tensor, version: int) -> None:
        """One step's sampled token and logprob of every row (kept only for the rows still running)."""
        self.tokens.append(tokens)
        self.logprobs.append(logprobs)
        self.versions.append(version)
        self.lengths += self.active
        stopped = (tokens[:, None] == self.stops).any(-1)
        self.active &= ~stopped & (self.lengths < self.limits)

    def responses(self) -> list[GenerateResponse]:
        """Every row's tokens, logprobs and versions up to its end; `stop` when it ended on a stop token."""
        import torch

        if not self.tokens:
            return [GenerateResponse([], [], [], "length") for _ in range(len(self.limits))]
        tokens = torch.stack(self.tokens, 1).tolist()
        logprobs = torch.stack(self.logprobs, 1).tolist()
        stops = self.stops.tolist()
        out = []
        for t, lp, k, s in zip(tokens, logprobs, self.lengths.tolist(), stops, strict=True):
            reason = "stop" if k and t[k - 1] in s else "length"
            out.append(GenerateResponse(t[:k], lp[:k], self.versions[:k], reason))
        return out

"""Micro-batches whose samples share a prompt: each prompt's forward runs once for all its samples.

A GRPO-family group is n samples of one prompt, and RL completions are often short next to their
prompt, so most of a plain step's forward and backward recomputes the same prompt n times. Here each
distinct prefix (the tokens before a sample's first trained token) runs once, left-padded; its key/value
cache is expanded to its samples - differentiably, so the gradients of every sample flow back into the
shared prefix - and the rest of each sample runs on top of it, right-padded, without its last token
(which is only ever a target). The logprobs are those of the plain path (a unit test checks it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


class Counted:
    """What a micro-batch trains: `mask` [B, T] marks the trained tokens; each row is scored through its
    sample's sampling (`temperature`, `top_k`, `top_p`, [B] each: `astraflow.logits`)."""

    mask: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor

    @property
    def n_sequences(self) -> int:
        return int((self.mask.sum(-1) > 0).sum())

    @property
    def n_tokens(self) -> int:
        return int(self.mask.sum())


@dataclass
class SharedMicroBatch(Counted):
    prefix_ids: torch.Tensor
    """[G, P]: the distinct prefixes, left-padded."""
    prefix_attention: torch.Tensor
    row: torch.Tensor
    """[B]: the prefix row of each sample."""
    suffix_ids: torch.Tensor
    """[B, S]: each sample after its prefix, without its last token, right-padded (S may be 0)."""
    suffix_attention: torch.Tensor
    suffix_positions: torch.Tensor
    targets: torch.Tensor
    """[B, S + 1]: each sample's tokens after its prefix; `behav`, `mask`, `adv` aligned with them."""
    behav: torch.Tensor
    mask: torch.Tensor
    adv: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor


def sampling_rows(items: list) -> dict[str, torch.Tensor]:
    """The per-row sampling fields of a micro-batch of `items` (greedy rows are scored at temperature 1,
    as the engine reports them)."""
    return {
        "temperature": torch.tensor([s.temperature if s.temperature > 0 else 1.0 for s in items]),
        "top_k": torch.tensor([s.top_k for s in items], dtype=torch.int64),
        "top_p": torch.tensor([s.top_p for s in items], dtype=torch.float32),
    }


def prefix_length(tokens: np.ndarray, mask: np.ndarray) -> int:
    """Tokens before the first trained one (at least one token is left after it)."""
    first = int(np.argmax(mask > 0)) if mask.any() else len(tokens)
    return min(first, len(tokens) - 1)


def shared_micro_batches(items: list, max_tokens: int, pad_id: int = 0) -> list[SharedMicroBatch] | None:
    """Samples grouped by prefix, packed into micro-batches of about `max_tokens` padded tokens; None
    when some sample has no prefix (its first token is trained) or one prompt's samples exceed the
    budget: the plain path handles those."""
    groups: dict[bytes, list] = {}
    for s in items:
        p = prefix_length(s.tokens, s.mask)
        if p < 1:
            return None
        groups.setdefault(s.tokens[:p].tobytes(), []).append((p, s))
    if any(_cost([g]) > max_tokens for g in groups.values()):
        return None  # the plain path may split a group over several micro-batches
    ordered = sorted(groups.values(), key=lambda g: -max(len(s.tokens) for _, s in g))
    out, current = [], []
    for g in ordered:
        if current and _cost([*current, g]) > max_tokens:
            out.append(_collate(current, pad_id))
            current = []
        current.append(g)
    if current:
        out.append(_collate(current, pad_id))
    return out


def _cost(groups: list[list]) -> int:
    prefix = max(p for g in groups for p, _ in g)
    suffix = max(len(s.tokens) - p for g in groups for p, s in g)
    return len(groups) * prefix + sum(len(g) for g in groups) * suffix


def _collate(groups: list[list], pad_id: int) -> SharedMicroBatch:
    width = max(p for g in groups for p, _ in g)
    samples = [(i, p, s) for i, g in enumerate(groups) for p, s in g]
    rest = max(len(s.tokens) - p for _, p, s in samples)
    prefix_ids = np.full((len(groups), width), pad_id, np.int64)
    prefix_attention = np.zeros((len(groups), width), np.int64)
    for i, g in enumerate(groups):
        p, s = g[0]
        prefix_ids[i, width - p :], prefix_attention[i, width - p :] = s.tokens[:p], 1
    b = len(samples)
    targets = np.full((b, rest), pad_id, np.int64)
    behav, mask, adv = (np.zeros((b, rest), np.float32) for _ in range(3))
    positions = np.zeros((b, rest), np.int64)
    for j, (_, p, s) in enumerate(samples):
        n = len(s.tokens) - p
        targets[j, :n], behav[j, :n], mask[j, :n] = s.tokens[p:], s.behav[p:], s.mask[p:]
        adv[j, :n], positions[j] = s.advantage, p + np.arange(rest)
    attention = (
        np.arange(rest)[None, :] < np.array([len(s.tokens) - p for _, p, s in samples])[:, None]
    ).astype(np.int64)
    t = torch.from_numpy
    return SharedMicroBatch(
        prefix_ids=t(prefix_ids),
        prefix_attention=t(prefix_attention),
        row=torch.tensor([i for i, _, _ in samples]),
        suffix_ids=t(targets[:, :-1].copy()),
        suffix_attention=t(attention[:, :-1].copy()),
        suffix_positions=t(positions[:, :-1].copy()),
        targets=t(targets),
        behav=t(behav),
        mask=t(mask),
        adv=t(adv),
        **sampling_rows([s for _, _, s in samples]),
    )


def shared_logits(model, mb: SharedMicroBatch) -> list[torch.Tensor]:
    """The logits that predict `mb.targets`, in pieces along the columns ([B, 1, vocab] from the prefix,
    then [B, S, vocab] from the suffix when S > 0): concatenating them would copy every logit once more."""
    from transformers import DynamicCache

    positions = (mb.prefix_attention.cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=mb.prefix_ids,
        attention_mask=mb.prefix_attention,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=1,  # only the prefix's last position predicts a target
    )
    first = out.logits[:, -1:][mb.row]
    if mb.suffix_ids.shape[1] == 0:
        return [first]
    cache = DynamicCache([(k[mb.row], v[mb.row]) for k, v, *_ in out.past_key_values])
    rest = model(
        input_ids=mb.suffix_ids,
        attention_mask=torch.cat([mb.prefix_attention[mb.row], mb.suffix_attention], 1),
        position_ids=mb.suffix_positions,
        past_key_values=cache,
        use_cache=True,
    )
    return [first, rest.logits]

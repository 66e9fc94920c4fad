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

from astraflow.messages import Batch
from astraflow.trainer.prefix import Counted, SharedMicroBatch, shared_logits, shared_micro_batches


@dataclass(frozen=True)
class Sample:
    tokens: np.ndarray
    behav: np.ndarray
    mask: np.ndarray
    advantage: float
    version_lag: int
    """Trainer version the batch was formed for minus the oldest version in the sample's group."""


@dataclass
class MicroBatch(Counted):
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    targets: torch.Tensor
    behav: torch.Tensor
    mask: torch.Tensor
    adv: torch.Tensor


def samples(batch: Batch) -> list[Sample]:
    out = []
    for group in batch.groups:
        lag = batch.version - group.min_version
        for traj, adv in zip(group.trajectories, group.advantages, strict=True):
            out.append(Sample(traj.token_ids, traj.logprobs, traj.loss_mask, float(adv), lag))
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
    )


def token_logprobs(model, mb: MicroBatch, with_entropy: bool = False):
    """log pi(target) at every position, and (optionally) the entropy of each predicted distribution."""
    if isinstance(mb, SharedMicroBatch):
        logits = shared_logits(model, mb).float()
    else:
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits[:, :-1].float()
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, mb.targets.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return logp, None
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy.detach()

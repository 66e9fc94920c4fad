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
from astraflow.trainer import head
from astraflow.trainer.head import LOGPROB_CHUNK_ROWS, target_logprobs
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


def token_logprobs(model, mb: MicroBatch, with_entropy: bool = False, chunk_rows: int = LOGPROB_CHUNK_ROWS):
    """log pi(target) at every position under each row's sampling (its temperature, top-k and top-p: the
    distribution its engine sampled from, `astraflow.logits`), and (optionally) the entropy of each such
    distribution (detached); float32, computed `chunk_rows` positions at a time (see `target_logprobs`), the
    logits a few thousand positions at a time (`head.logprobs`)."""
    rows = (mb.temperature, mb.top_k, mb.top_p)
    if isinstance(mb, SharedMicroBatch):
        parts, start = [], 0
        for logits in shared_logits(model, mb):  # the pieces of the targets' columns, in order
            end = start + logits.shape[1]
            parts.append(target_logprobs(logits, mb.targets[:, start:end], with_entropy, chunk_rows, rows))
            start = end
        logp = torch.cat([p for p, _ in parts], 1)
        return logp, torch.cat([e for _, e in parts], 1) if with_entropy else None
    # The last position predicts nothing: a dummy target there (the hidden states stay one contiguous view).
    targets = torch.nn.functional.pad(mb.targets, (0, 1))
    logp, entropy = head.logprobs(
        model, mb.input_ids, mb.attention_mask, targets, with_entropy, chunk_rows, rows
    )
    return logp[:, :-1], entropy[:, :-1] if with_entropy else None

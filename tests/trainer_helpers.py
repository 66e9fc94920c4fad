"""A small Batch whose behaviour logprobs are the model's own (as an engine sampling from it reports)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from astraflow.messages import Batch, RolloutGroup, SampleGroup, Trajectory, pack


def behaviour(model, seq: list[int]) -> np.ndarray:
    """The model's own logprob of each token (what an engine sampling from it would report)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([seq])).logits[0, :-1]
        logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq[1:]).unsqueeze(-1)).squeeze(-1)
    return np.concatenate([[0.0], logp.numpy()]).astype(np.float32)


def make_batch(
    model,
    seqs: list[list[int]],
    rewards: list[float],
    spoil: Callable[[int, Trajectory], Trajectory] | None = None,
) -> Batch:
    """A batch of one group; `spoil(i, trajectory)` may change each trajectory (after the behaviour logprobs
    were computed, so token ids outside the vocabulary can be put in)."""
    trajs = []
    for s, r in zip(seqs, rewards, strict=True):
        n = len(s)
        mask = np.zeros(n, np.uint8)
        mask[2:] = 1  # two prompt tokens
        trajs.append(
            Trajectory(
                model="policy",
                token_ids=np.array(s, np.int32),
                logprobs=behaviour(model, s) * mask,
                loss_mask=mask,
                versions=np.where(mask == 1, 0, -1).astype(np.int32),
                reward=r,
            )
        )
    if spoil is not None:
        trajs = [spoil(i, t) for i, t in enumerate(trajs)]
    r = np.array(rewards)
    adv = ((r - r.mean()) / (r.std() + 1e-6)).astype(np.float32)
    rollout = RolloutGroup(uid="g", raas="r", version=0, trajectories=trajs)
    group = SampleGroup(
        uid="g",
        model="policy",
        min_version=0,
        max_version=0,
        rollout=pack(rollout),
        indices=list(range(len(trajs))),
        advantages=adv,
    )
    return Batch(uid="policy:1", model="policy", version=0, groups=[group])

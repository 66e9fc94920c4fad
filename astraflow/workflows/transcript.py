"""A multi-turn episode's token record: sampled turns (trained, with the version of each token) and
observations no policy produced (tool output, sub-episode results: loss mask 0, version -1)."""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from astraflow.engines.base import GenerateResponse
from astraflow.messages import Trajectory
from astraflow.workflows.rlvr import processing


def cut_after_calls(
    tokenizer: Any, token_ids: list[int], pattern: re.Pattern[str], limit: int = 1
) -> tuple[int, list[str]]:
    """How many tokens make up the turn up to the end of its first `limit` complete calls (`pattern`'s
    matches), and the calls' first groups ([]: no call; then the whole turn counts).

    "The first k tokens contain n complete calls" only turns true as k grows: a binary search finds the
    shortest such prefix in O(log n) decodes."""
    calls = [m.group(1) for m in pattern.finditer(tokenizer.decode(token_ids, skip_special_tokens=True))]
    calls = calls[:limit]
    if not calls:
        return len(token_ids), []

    def holds(k: int) -> bool:
        text = tokenizer.decode(token_ids[:k], skip_special_tokens=True)
        return len(pattern.findall(text)) >= len(calls)

    lo, hi = 1, len(token_ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if holds(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo, calls


class Transcript:
    """Prompt, then sampled turns and observations, as the trajectory's parallel arrays."""

    def __init__(self, prompt_ids: list[int]) -> None:
        n = len(prompt_ids)
        self.ids, self.logprobs, self.mask, self.versions = list(prompt_ids), [0.0] * n, [0] * n, [-1] * n
        self.processing: dict[str, float] | None = None
        """How the sampled turns were sampled (one trajectory, one processing: the trainer scores it so)."""

    def sampled(self, resp: GenerateResponse, k: int) -> list[int]:
        """Append the first `k` tokens of `resp` (trained, each with the version that sampled it). Raises
        ValueError for a turn sampled with another temperature, top-k or top-p than the earlier ones."""
        turn = processing(resp.sampling)
        if self.processing not in (None, turn):
            raise ValueError(f"a trajectory's turns are sampled alike: {turn} after {self.processing}")
        self.processing = turn
        self.ids += resp.token_ids[:k]
        self.logprobs += resp.logprobs[:k]
        self.mask += [1] * k
        self.versions += resp.versions[:k]
        return resp.token_ids[:k]

    def observed(self, token_ids: list[int]) -> None:
        """Append tokens no policy produced."""
        n = len(token_ids)
        self.ids += token_ids
        self.logprobs += [0.0] * n
        self.mask += [0] * n
        self.versions += [-1] * n

    def trajectory(
        self,
        model: str,
        reward: float,
        finish: str,
        error: str | None,
        metrics: dict[str, float] | None = None,
    ) -> Trajectory:
        return Trajectory(
            model=model,
            token_ids=np.asarray(self.ids, np.int32),
            logprobs=np.asarray(self.logprobs, np.float32),
            loss_mask=np.asarray(self.mask, np.uint8),
            versions=np.asarray(self.versions, np.int32),
            reward=reward,
            finish_reason=finish,
            error=error,
            metrics=metrics or {},
            **(self.processing or processing(None)),
        )

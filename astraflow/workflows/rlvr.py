"""`rlvr`: one turn, one policy, a verifiable reward."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from astraflow.engines.base import Engine, GenerateRequest, GenerateResponse, SamplingParams
from astraflow.messages import Trajectory
from astraflow.workflows.api import EpisodeResult, RolloutWorkflow, reward_name, workflow


def encode_prompt(tokenizer: Any, sample: dict[str, Any], chat: bool) -> tuple[str, list[int]]:
    """The prompt text and its token ids: `sample["prompt"]` as is, or through the chat template."""
    if chat:
        messages = sample.get("messages") or [{"role": "user", "content": sample["prompt"]}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        text = sample["prompt"]
    return text, tokenizer.encode(text, add_special_tokens=False)


def processing(params: SamplingParams | None) -> dict[str, float]:
    """The fields of a Trajectory that say how its logprobs were sampled (plain sampling when unknown)."""
    p = params or SamplingParams()
    return {"temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p}


def trajectory(
    model: str, prompt_ids: list[int], resp: GenerateResponse, reward: float, error: str | None
) -> Trajectory:
    """Prompt tokens (not trained on, no version) followed by the sampled completion, with the sampling its
    logprobs are of."""
    p, c = len(prompt_ids), len(resp.token_ids)
    return Trajectory(
        model=model,
        token_ids=np.asarray(prompt_ids + resp.token_ids, dtype=np.int32),
        logprobs=np.concatenate([np.zeros(p, np.float32), np.asarray(resp.logprobs, np.float32)]),
        loss_mask=np.concatenate([np.zeros(p, np.uint8), np.ones(c, np.uint8)]),
        versions=np.concatenate([np.full(p, -1, np.int32), np.asarray(resp.versions, np.int32)]),
        reward=reward,
        finish_reason=resp.finish_reason,
        error=error,
        **processing(resp.sampling),
    )


@workflow("rlvr", tools=False)
class RLVR(RolloutWorkflow):
    """Options: `chat` (apply the chat template, default False), `reward` (default: the sample's
    `reward` field, else exact_match)."""

    async def run_episode(self, engines: Mapping[str, Engine], sample: dict[str, Any]) -> EpisodeResult:
        model = next(iter(engines))
        tokenizer = self.ctx.tokenizers[model]
        text, prompt_ids = encode_prompt(tokenizer, sample, bool(self.ctx.options.get("chat")))
        resp = await engines[model].generate(GenerateRequest(prompt_ids, self.ctx.sampling))
        completion = tokenizer.decode(resp.token_ids, skip_special_tokens=True)
        name = reward_name(sample, self.ctx.options)
        score, error = await self.ctx.rewards.score(
            name, text, completion, sample, prompt_ids, resp.token_ids
        )
        return EpisodeResult([trajectory(model, prompt_ids, resp, score, error)])

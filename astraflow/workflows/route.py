"""`route`: a small policy answers, or hands the question off to a larger model.

The small policy's completion either answers or starts with the hand-off marker; then the large model
(another policy, trained or not: e.g. a fixed `openai` endpoint with `train: false` and its tokenizer's
directory in `engine.tokenizer`) answers the same prompt and its answer is the episode's. The small
policy is rewarded for the episode's accuracy minus `handoff_cost` when it handed off, so it learns to
hand off only what it cannot answer itself. The large model's trajectory carries its plain accuracy (it
goes into no batch when that policy is not trained).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from astraflow.engines.base import Engine, GenerateRequest
from astraflow.workflows.api import EpisodeResult, RolloutWorkflow, reward_name, workflow
from astraflow.workflows.rlvr import encode_prompt, trajectory


@workflow("route")
class Route(RolloutWorkflow):
    """Options: `small_model` (default: the group's first policy), `large_model` (default: its second),
    `handoff` (the marker that hands off, "<large>"), `handoff_cost` (0.2), `chat`, `reward`."""

    async def run_episode(self, engines: Mapping[str, Engine], sample: dict[str, Any]) -> EpisodeResult:
        opts, models = self.ctx.options, list(engines)
        small = opts.get("small_model", models[0])
        large = opts.get("large_model", next((m for m in models if m != small), None))
        if large is None:
            raise ValueError("route needs two models: [small, large]")
        chat, name = bool(opts.get("chat")), reward_name(sample, opts)
        tok = self.ctx.tokenizers[small]
        text, ids = encode_prompt(tok, sample, chat)
        resp = await engines[small].generate(GenerateRequest(ids, self.ctx.sampling))
        answer = tok.decode(resp.token_ids, skip_special_tokens=True)
        if not answer.lstrip().startswith(str(opts.get("handoff", "<large>"))):
            score, error = await self.ctx.rewards.score(name, text, answer, sample, ids, resp.token_ids)
            return EpisodeResult([trajectory(small, ids, resp, score, error)])

        l_tok = self.ctx.tokenizers[large]
        l_text, l_ids = encode_prompt(l_tok, sample, chat)
        l_resp = await engines[large].generate(GenerateRequest(l_ids, self.ctx.sampling))
        l_answer = l_tok.decode(l_resp.token_ids, skip_special_tokens=True)
        score, error = await self.ctx.rewards.score(name, l_text, l_answer, sample, l_ids, l_resp.token_ids)
        cost = float(opts.get("handoff_cost", 0.2))
        return EpisodeResult(
            [
                trajectory(small, ids, resp, score - cost, error),
                trajectory(large, l_ids, l_resp, score, error),
            ]
        )

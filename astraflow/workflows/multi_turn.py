"""`multi_turn`: the policy calls a sandboxed Python tool over several turns.

A turn ends at `</python>`: the code between `<python>` and it runs in the sandbox and its output comes
back as `<output>...</output>` tokens that no policy produced (loss mask 0, version -1). The episode
ends at a turn without a tool call (its text is scored) or after `max_turns`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from astraflow.engines.base import Engine, GenerateRequest
from astraflow.workflows.api import EpisodeResult, RolloutWorkflow, reward_name, workflow
from astraflow.workflows.rlvr import encode_prompt
from astraflow.workflows.sandbox import run_python
from astraflow.workflows.transcript import Transcript, cut_after_calls

TOOL_CALL = re.compile(r"<python>(.*?)</python>", re.DOTALL)


@workflow("multi_turn")
class MultiTurn(RolloutWorkflow):
    """Options: `max_turns` (4), `tool_cpu_s` (2), `tool_memory_mb` (256), `tool_wall_s` (5), `chat`,
    `reward` (default: the sample's `reward`, else exact_match)."""

    async def run_episode(self, engines: Mapping[str, Engine], sample: dict[str, Any]) -> EpisodeResult:
        opts, model = self.ctx.options, next(iter(engines))
        tokenizer = self.ctx.tokenizers[model]
        text, prompt_ids = encode_prompt(tokenizer, sample, bool(opts.get("chat")))
        record = Transcript(prompt_ids)
        final, final_ids, finish = "", [], "length"
        for _ in range(int(opts.get("max_turns", 4))):
            resp = await engines[model].generate(GenerateRequest(list(record.ids), self.ctx.sampling))
            k, calls = cut_after_calls(tokenizer, resp.token_ids, TOOL_CALL)
            final_ids, finish = record.sampled(resp, k), resp.finish_reason
            final = tokenizer.decode(final_ids, skip_special_tokens=True)
            if not calls:
                break
            result = await run_python(
                calls[0],
                cpu_s=int(opts.get("tool_cpu_s", 2)),
                memory_mb=int(opts.get("tool_memory_mb", 256)),
                wall_s=float(opts.get("tool_wall_s", 5.0)),
            )
            record.observed(
                tokenizer.encode(f"\n<output>\n{result.output}</output>\n", add_special_tokens=False)
            )
        name = reward_name(sample, opts)
        score, error = await self.ctx.rewards.score(name, text, final, sample, prompt_ids, final_ids)
        return EpisodeResult([record.trajectory(model, score, finish, error)])

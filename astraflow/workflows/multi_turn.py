"""`multi_turn`: the policy calls a tool over several turns.

The `python` tool (the default): a turn ends at `</python>`, the code between `<python>` and it runs in
the sandbox and its output comes back as `<output>...</output>` tokens that no policy produced (loss mask
0, version -1). The `calculator` tool: a turn ends at `<expression>`, and the value comes back as `value|`
(see `calculator`). The episode ends at a turn without a tool call (its text is scored) or after
`max_turns`. Each trajectory reports the metric `tool_call`: 1.0 when the episode called the tool and
every call ran without error, else 0.0 (the dataflow averages it per step, as the reward).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from astraflow.engines.base import Engine, GenerateRequest
from astraflow.workflows import calculator
from astraflow.workflows.api import EpisodeResult, RolloutWorkflow, reward_name, workflow
from astraflow.workflows.rlvr import encode_prompt
from astraflow.workflows.sandbox import ToolResult, run_python
from astraflow.workflows.transcript import Transcript, cut_after_calls

TOOL_CALL = re.compile(r"<python>(.*?)</python>", re.DOTALL)


@dataclass(frozen=True)
class Tool:
    call: re.Pattern[str]
    """Matches a complete call; group 1 is the tool's input."""
    run: Callable[[str, Mapping[str, Any]], Awaitable[ToolResult]]
    """(input, the workflow options) -> result."""
    observation: Callable[[str], str]
    """The text appended after a call, from the tool's output."""


async def _python(code: str, opts: Mapping[str, Any]) -> ToolResult:
    return await run_python(
        code,
        cpu_s=int(opts.get("tool_cpu_s", 2)),
        memory_mb=int(opts.get("tool_memory_mb", 256)),
        wall_s=float(opts.get("tool_wall_s", 5.0)),
    )


async def _calculator(expression: str, opts: Mapping[str, Any]) -> ToolResult:
    return calculator.evaluate(expression)


TOOLS = {
    "python": Tool(TOOL_CALL, _python, lambda output: f"\n<output>\n{output}</output>\n"),
    "calculator": Tool(calculator.CALL, _calculator, calculator.observation),
}


@workflow("multi_turn")
class MultiTurn(RolloutWorkflow):
    """Options: `tool` (`python` or `calculator`), `max_turns` (4), `tool_cpu_s` (2), `tool_memory_mb`
    (256), `tool_wall_s` (5) for the python tool, `chat`, `reward` (default: the sample's `reward`, else
    exact_match)."""

    async def run_episode(self, engines: Mapping[str, Engine], sample: dict[str, Any]) -> EpisodeResult:
        opts, model = self.ctx.options, next(iter(engines))
        tokenizer = self.ctx.tokenizers[model]
        try:
            tool = TOOLS[opts.get("tool", "python")]
        except KeyError:
            raise ValueError(f"unknown tool: {opts.get('tool')!r} (built in: {', '.join(TOOLS)})") from None
        text, prompt_ids = encode_prompt(tokenizer, sample, bool(opts.get("chat")))
        record = Transcript(prompt_ids)
        final, final_ids, finish, ran, failed = "", [], "length", 0, 0
        for _ in range(int(opts.get("max_turns", 4))):
            resp = await engines[model].generate(GenerateRequest(list(record.ids), self.ctx.sampling))
            k, calls = cut_after_calls(tokenizer, resp.token_ids, tool.call)
            final_ids, finish = record.sampled(resp, k), resp.finish_reason
            final = tokenizer.decode(final_ids, skip_special_tokens=True)
            if not calls:
                break
            result = await tool.run(calls[0], opts)
            ran, failed = ran + 1, failed + (not result.ok)
            record.observed(tokenizer.encode(tool.observation(result.output), add_special_tokens=False))
        name = reward_name(sample, opts)
        score, error = await self.ctx.rewards.score(name, text, final, sample, prompt_ids, final_ids)
        metrics = {"tool_call": float(ran > 0 and not failed)}
        return EpisodeResult([record.trajectory(model, score, finish, error, metrics)])

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

import numpy as np

from astraflow.engines.base import Engine, GenerateRequest
from astraflow.messages import Trajectory
from astraflow.workflows import calculator
from astraflow.workflows.api import EpisodeResult, RolloutWorkflow, reward_name, workflow
from astraflow.workflows.rlvr import encode_prompt
from astraflow.workflows.sandbox import ToolResult, run_python

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


def cut_at_tool_call(
    tokenizer: Any, token_ids: list[int], pattern: re.Pattern[str] = TOOL_CALL
) -> tuple[int, str | None]:
    """How many tokens make up the turn up to the first complete tool call, and its code (None: no call).

    "The first k tokens contain a complete call" only turns true as k grows: a binary search finds the
    shortest such prefix in O(log n) decodes."""
    match = pattern.search(tokenizer.decode(token_ids, skip_special_tokens=True))
    if match is None:
        return len(token_ids), None
    lo, hi = 1, len(token_ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if pattern.search(tokenizer.decode(token_ids[:mid], skip_special_tokens=True)):
            hi = mid
        else:
            lo = mid + 1
    return lo, match.group(1)


@workflow("multi_turn")
class MultiTurn(RolloutWorkflow):
    """Options: `tool` (`python` or `calculator`), `max_turns` (4), `tool_cpu_s` (2), `tool_memory_mb`
    (256), `tool_wall_s` (5) for the python tool, `chat`, `reward` (default: the sample's `reward`, else
    exact_match)."""

    async def run_episode(self, engines: Mapping[str, Engine], sample: dict[str, Any]) -> EpisodeResult:
        opts, model = self.ctx.options, next(iter(engines))
        tokenizer = self.ctx.tokenizers[model]
        text, prompt_ids = encode_prompt(tokenizer, sample, bool(opts.get("chat")))
        n = len(prompt_ids)
        ids, logprobs, mask, versions = list(prompt_ids), [0.0] * n, [0] * n, [-1] * n
        try:
            tool = TOOLS[opts.get("tool", "python")]
        except KeyError:
            raise ValueError(f"unknown tool: {opts.get('tool')!r} (built in: {', '.join(TOOLS)})") from None
        final, finish, calls, failed = "", "length", 0, 0
        for _ in range(int(opts.get("max_turns", 4))):
            resp = await engines[model].generate(GenerateRequest(list(ids), self.ctx.sampling))
            k, code = cut_at_tool_call(tokenizer, resp.token_ids, tool.call)
            ids += resp.token_ids[:k]
            logprobs += resp.logprobs[:k]
            mask += [1] * k
            versions += resp.versions[:k]
            final, finish = tokenizer.decode(resp.token_ids[:k], skip_special_tokens=True), resp.finish_reason
            if code is None:
                break
            result = await tool.run(code, opts)
            calls, failed = calls + 1, failed + (not result.ok)
            observation = tokenizer.encode(tool.observation(result.output), add_special_tokens=False)
            ids += observation
            logprobs += [0.0] * len(observation)
            mask += [0] * len(observation)
            versions += [-1] * len(observation)
        name = reward_name(sample, opts)
        score, error = await self.ctx.rewards.score(name, text, final, sample)
        traj = Trajectory(
            model=model,
            token_ids=np.asarray(ids, np.int32),
            logprobs=np.asarray(logprobs, np.float32),
            loss_mask=np.asarray(mask, np.uint8),
            versions=np.asarray(versions, np.int32),
            reward=score,
            finish_reason=finish,
            error=error,
            metrics={"tool_call": float(calls > 0 and not failed)},
        )
        return EpisodeResult([traj])

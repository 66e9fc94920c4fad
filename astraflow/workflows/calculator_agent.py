"""An ordinary OpenAI-API agent for the calculator task, the example of `recipes/calculator-agent.yaml`.

Nothing in it knows astraflow: it offers the model a `calculator` tool with the official `openai` client,
answers each tool call it reads from the reply with the tool's result, and asks again, for at most
`MAX_TURNS` turns; the reward is 1.0 when the final answer is the sample's. Two forms, one program:
- a function: `workflow_options.agent: astraflow.workflows.calculator_agent:solve`;
- a command: `workflow_options.command: python -m astraflow.workflows.calculator_agent` (the sample as JSON on
  stdin, `OPENAI_BASE_URL` and `OPENAI_API_KEY` in the environment, the reward printed last).
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from astraflow.workflows import calculator

MAX_TURNS = 3
MODEL = "policy"


async def solve(client: Any, sample: dict[str, Any]) -> float:
    """Run the conversation for `sample` through `client` (an `openai.AsyncOpenAI`); 1.0 if it ends with
    the sample's answer, else 0.0."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": sample["prompt"]}]
    answer = ""
    for _ in range(MAX_TURNS):
        reply = await client.chat.completions.create(model=MODEL, messages=messages, tools=[calculator.TOOL])
        message = reply.choices[0].message
        answer = message.content or ""
        if not message.tool_calls:
            break
        messages.append(message.model_dump(include={"role", "content", "tool_calls"}))
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": _run(call.function)})
    return float(answer.strip() == sample["answer"])


def _run(function: Any) -> str:
    """The calculator's output for one call (an error text when the call is malformed)."""
    try:
        expression = json.loads(function.arguments)["expression"]
    except (ValueError, KeyError, TypeError):
        return "error"
    return calculator.evaluate(str(expression)).output if function.name == "calculator" else "error"


async def _main() -> None:
    from openai import AsyncOpenAI

    sample = json.load(sys.stdin)
    async with AsyncOpenAI() as client:  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
        print(await solve(client, sample))


if __name__ == "__main__":
    asyncio.run(_main())

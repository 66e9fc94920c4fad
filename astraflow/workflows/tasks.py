"""Built-in synthetic tasks with verifiable answers, small enough for a tiny model to learn on a CPU."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from astraflow.workflows import calculator


@dataclass(frozen=True)
class Task:
    name: str
    sample: Callable[[random.Random], dict[str, Any]]
    """One dataset row: `prompt`, `answer` and whatever its reward reads."""
    reward: str
    """Name of the registered reward that scores it."""
    max_new_tokens: int
    demo: Callable[[dict[str, Any], random.Random], list[tuple[str, bool]]] | None = None
    """A supervised warm start's completion for a row, as (text, trained) segments; None: the answer.
    Untrained segments are what a tool would append (masked from the loss, as in RL)."""
    tools: tuple[dict[str, Any], ...] = ()
    """When set, the policy sees a row as an agent sends it: the prompt as a user message through the
    tokenizer's chat template, with these tool definitions (OpenAI's format)."""


def _addition(rng: random.Random) -> dict[str, Any]:
    a, b = rng.randrange(100), rng.randrange(100)
    return {"prompt": f"{a:02d}+{b:02d}=", "answer": str(a + b)}


def _reverse(rng: random.Random) -> dict[str, Any]:
    word = "".join(rng.choice("abcdef") for _ in range(rng.randint(3, 5)))
    return {"prompt": f"{word}>", "answer": word[::-1]}


def _multiplication(rng: random.Random) -> dict[str, Any]:
    a, b = rng.randrange(10, 1000), rng.randrange(10, 100)
    return {"prompt": f"{a}*{b}=", "answer": str(a * b)}


CALC_TOOL_SHARE = 0.25
"""The share of the calculator warm start's demonstrations that call the tool (the rest answer directly)."""


def _calculator_demo(row: dict[str, Any], rng: random.Random) -> list[tuple[str, bool]]:
    """`123*45=` -> `<123*45>` (the call), `5535|` (the calculator's output), `5535`; or just `5535`."""
    if rng.random() >= CALC_TOOL_SHARE:
        return [(row["answer"], True)]
    answer = row["answer"]
    return [
        (calculator.call(row["prompt"].rstrip("=")), True),
        (calculator.observation(answer), False),
        (answer, True),
    ]


AGENT_TOOL_SHARE = 0.5
"""The same share for the agent's warm start: its copies span more tokens (the expression from the user's
turn into the call's JSON, the result from the tool's turn), which a quarter of 300 steps left at 20-50%
right; half of them trains the copying twice as often."""


def _calculator_agent_demo(row: dict[str, Any], rng: random.Random) -> list[tuple[str, bool]]:
    """`_calculator_demo` in the chat format of `tiny.AGENT_TEMPLATE`: a Hermes-style tool call ending
    the assistant's turn, the tool's turn, then the answer in a new assistant turn."""
    if rng.random() >= AGENT_TOOL_SHARE:
        return [(row["answer"], True)]
    answer = row["answer"]
    call = {"name": "calculator", "arguments": {"expression": row["prompt"].rstrip("=")}}
    return [
        (f"<tool_call>{json.dumps(call)}</tool_call><|im_end|>", True),
        (
            f"\n<|im_start|>tool\n<tool_response>{answer}</tool_response><|im_end|>\n<|im_start|>assistant\n",
            False,
        ),
        (answer, True),
    ]


TASKS: dict[str, Task] = {
    "addition": Task("addition", _addition, reward="exact_match", max_new_tokens=4),
    "reverse": Task("reverse", _reverse, reward="exact_match", max_new_tokens=6),
    # Two-to-three-digit by two-digit products: beyond a tiny model, easy with the `calculator` tool.
    "calculator": Task(
        "calculator", _multiplication, reward="exact_match", max_new_tokens=9, demo=_calculator_demo
    ),
    # The same through an agent program and the OpenAI-compatible endpoint (`recipes/calculator-agent.yaml`).
    "calculator_agent": Task(
        "calculator_agent",
        _multiplication,
        reward="exact_match",
        max_new_tokens=24,
        demo=_calculator_agent_demo,
        tools=(calculator.TOOL,),
    ),
}


def get_task(name: str) -> Task:
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task: {name!r} (built in: {', '.join(TASKS)})") from None


def rows(task: str, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """`n` rows of `task`, the same for the same seed."""
    rng = random.Random(seed)
    t = get_task(task)
    return [t.sample(rng) for _ in range(n)]

"""Tool calls in the model's own format, to and from the OpenAI API's.

The model writes Hermes-style calls, as Qwen's and Hermes' chat templates teach it:
`<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>` (vLLM's `hermes`
parser reads the same). `parse` splits a completion into its text and its calls; a block whose JSON does
not parse, or that has no string `name`, stays in the text, so the agent sees what the model wrote.
`for_template` turns the OpenAI messages an agent sends back into what a chat template renders: each
call's `arguments` (a JSON string in the API) as the object the model wrote, as vLLM does.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str
    """The arguments as a JSON string, as the OpenAI API carries them."""
    id: str

    def openai(self) -> dict[str, Any]:
        """The call as a chat completion message's `tool_calls` item."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def parse(text: str) -> tuple[str, list[ToolCall]]:
    """`text` without its well-formed tool call blocks (stripped), and those calls in order."""
    calls: list[ToolCall] = []

    def take(match: re.Match[str]) -> str:
        call = _call(match.group(1))
        if call is None:
            return match.group(0)
        calls.append(call)
        return ""

    rest = BLOCK.sub(take, text)
    return (rest.strip() if calls else text), calls


def _call(body: str) -> ToolCall | None:
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(data["name"], text, f"call_{secrets.token_hex(12)}")


def for_template(messages: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with each assistant tool call's `arguments` decoded from JSON (left as the string
    when it is not JSON), so the template renders them as the model wrote them."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if message.get("role") == "assistant" and isinstance(calls, list):
            message = {**message, "tool_calls": [_decoded(c) for c in calls]}
        out.append(message)
    return out


def _decoded(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}

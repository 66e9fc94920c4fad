"""The `calculator` tool of `multi_turn`: `<12*34>` in a turn asks for 12*34, and `408|` comes back.

The tool evaluates integer arithmetic (`+`, `-`, `*`, parentheses) by walking the parsed expression, so it
runs no code and needs no sandbox process (a sandboxed interpreter per call costs 30-60 ms here, more than
a whole episode of the tiny model). Anything else is refused with a short error as the output; operands
and results are capped so no call can take long.
"""

from __future__ import annotations

import ast
import re

from astraflow.workflows.sandbox import ToolResult

CALL = re.compile(r"<([^<>|]*)>")
"""A call: the expression between `<` and `>`."""
MAX_CHARS, MAX_DIGITS = 40, 12
TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate integer arithmetic: +, -, * and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
"""The tool as an agent declares it to an OpenAI-compatible endpoint (`calculator_agent`)."""


def call(expression: str) -> str:
    return f"<{expression}>"


def observation(output: str) -> str:
    """What the tool appends after a call (masked from the loss): the output and `|`."""
    return f"{output}|"


def evaluate(expression: str) -> ToolResult:
    """The value of `expression`, or ok=False with `error` when it is not small integer arithmetic."""
    if len(expression) > MAX_CHARS:
        return ToolResult(False, "error")
    try:
        value = _value(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError):
        return ToolResult(False, "error")
    return ToolResult(True, str(value))


_OPS = {ast.Add: int.__add__, ast.Sub: int.__sub__, ast.Mult: int.__mul__}


def _value(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        value = node.value
    elif isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        value = _OPS[type(node.op)](_value(node.left), _value(node.right))
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        value = -_value(node.operand)
    else:
        raise ValueError("not integer arithmetic")
    if len(str(abs(value))) > MAX_DIGITS:
        raise ValueError("too large")
    return value

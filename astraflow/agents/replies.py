"""The OpenAI API's request fields and reply bodies, for the endpoint (`server`).

Requests are data from a program: every field read here is checked (`BadRequest` says which is wrong).
Replies follow the API's shapes (`chat.completion`, `chat.completion.chunk`, `text_completion`), so the
official client and the agent frameworks built on it parse them.
"""

from __future__ import annotations

import json
import math
import secrets
import time
from collections.abc import Iterator
from typing import Any

from astraflow.agents.toolcalls import ToolCall
from astraflow.engines.base import SamplingParams


class BadRequest(ValueError):
    """A request the endpoint does not serve (HTTP 400, the message says why)."""


def sampling(body: dict[str, Any], default: SamplingParams) -> SamplingParams:
    """The request's sampling over the RaaS's: `temperature`, `top_p`, `top_k`, `seed`, and
    `max_completion_tokens` / `max_tokens`, at most the RaaS's `max_new_tokens` (the engines' budget)."""
    if body.get("n", 1) != 1:
        raise BadRequest("n: only 1 completion per request is served")
    temperature = _number(body, "temperature", default.temperature, 0.0, 2.0)
    top_p = _number(body, "top_p", default.top_p, 1e-9, 1.0)
    top_k = int(_number(body, "top_k", default.top_k, 0, 1e9))
    ceiling = default.max_new_tokens
    asked = body.get("max_completion_tokens", body.get("max_tokens"))
    limit = ceiling if asked is None else int(_number({"max_tokens": asked}, "max_tokens", 1, 1, 1e9))
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise BadRequest("seed: an integer expected")
    return SamplingParams(temperature, top_p, top_k, min(limit, ceiling), seed=seed)


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise BadRequest(f"{name}: a number expected")
    if not low <= value <= high:
        raise BadRequest(f"{name}: {value} is outside [{low}, {high}]")
    return value


def messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
        raise BadRequest("messages: a non-empty list of message objects expected")
    for m in msgs:
        if not isinstance(m.get("role"), str):
            raise BadRequest("messages: every message needs a string role")
    return msgs


def tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The tool definitions to template, or None (none given, or `tool_choice: none`)."""
    given = body.get("tools")
    if given is None or body.get("tool_choice") == "none":
        return None
    if not isinstance(given, list) or not all(isinstance(t, dict) for t in given):
        raise BadRequest("tools: a list of tool objects expected")
    return given or None


def wants_logprobs(body: dict[str, Any]) -> bool:
    """Chat: `logprobs: true`; completions: `logprobs` a number (its alternatives are not served)."""
    asked = body.get("logprobs")
    return asked is True or (type(asked) is int and asked >= 0)


def _head(kind: str, model: str) -> dict[str, Any]:
    prefix = "chatcmpl" if kind.startswith("chat") else "cmpl"
    return {
        "id": f"{prefix}-{secrets.token_hex(12)}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
    }


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def finish(reason: str, calls: list[ToolCall]) -> str:
    return "tool_calls" if calls else reason


def chat(
    model: str,
    content: str,
    calls: list[ToolCall],
    reason: str,
    n: tuple[int, int],
    logprobs: list[tuple[str, float]] | None = None,
) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
    if calls:
        message["tool_calls"] = [c.openai() for c in calls]
    scores = None
    if logprobs is not None:  # the sampled tokens' own logprobs; no alternatives are kept
        scores = {
            "content": [
                {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                for t, lp in logprobs
            ]
        }
    choice = {"index": 0, "message": message, "logprobs": scores, "finish_reason": finish(reason, calls)}
    return {**_head("chat.completion", model), "choices": [choice], "usage": usage(*n)}


def completion(
    model: str, text: str, reason: str, n: tuple[int, int], logprobs: list[tuple[str, float]] | None = None
) -> dict:
    scores = None
    if logprobs is not None:
        tokens = [t for t, _ in logprobs]
        offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        scores = {
            "tokens": tokens,
            "token_logprobs": [lp for _, lp in logprobs],
            "top_logprobs": None,
            "text_offset": offsets,
        }
    choice = {"index": 0, "text": text, "logprobs": scores, "finish_reason": reason}
    return {**_head("text_completion", model), "choices": [choice], "usage": usage(*n)}


def chat_chunks(
    model: str, pieces: list[str], calls: list[ToolCall], reason: str, n: tuple[int, int] | None
) -> Iterator[dict]:
    """A chat reply as stream chunks: the role, the text piece by piece, each tool call, the finish
    reason, then the usage when asked for (`stream_options.include_usage`)."""
    head = _head("chat.completion.chunk", model)

    def chunk(delta: dict, reason: str | None = None) -> dict:
        return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}

    yield chunk({"role": "assistant", "content": ""})
    for piece in pieces:
        yield chunk({"content": piece})
    for i, c in enumerate(calls):
        yield chunk({"tool_calls": [{"index": i, **c.openai()}]})
    yield chunk({}, finish(reason, calls))
    if n is not None:
        yield {**head, "choices": [], "usage": usage(*n)}


def completion_chunks(
    model: str, pieces: list[str], reason: str, n: tuple[int, int] | None
) -> Iterator[dict]:
    head = _head("text_completion", model)
    for piece in pieces:
        yield {**head, "choices": [{"index": 0, "text": piece, "logprobs": None, "finish_reason": None}]}
    yield {**head, "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": reason}]}
    if n is not None:
        yield {**head, "choices": [], "usage": usage(*n)}


def sse(event: dict | None) -> bytes:
    """One server-sent event; None is the stream's end (`[DONE]`)."""
    return b"data: " + (b"[DONE]" if event is None else json.dumps(event).encode()) + b"\n\n"


def error(message: str, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}

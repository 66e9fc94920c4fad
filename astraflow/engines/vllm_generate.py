"""The three ways a vLLM engine generates a request, each returning every token with the version of the
weights that sampled it:

- whole: one streamed call to the token-in/token-out endpoint, whose final chunk labels token spans with
  versions (weight sync by pause);
- chunks: completion calls of `chunk_tokens` each, continuing from the prompt plus the tokens so far, so a
  load lands between chunks and each chunk carries the version the server held when it started;
- on an adapter (LoRA): one completion call on the adapter newest when it starts.

A call starts only while the engine lets calls start (`wait_open`), and one that fails because the server
died is retried on its restart (`server_died`). Sampled (not greedy), unseeded requests with the same
context and sampling that arrive together (a prompt group's samples) share one call for their n
completions (`merge`).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Hashable
from dataclasses import replace
from typing import Protocol

from astraflow.engines import vllm_lora
from astraflow.engines.base import GenerateRequest, GenerateResponse
from astraflow.engines.client import CallError, GenerationClient
from astraflow.engines.merge import Merger
from astraflow.engines.settings import EngineSettings
from astraflow.engines.vllm_server import (
    GENERATE_PATH,
    SERVED_NAME,
    GenerateStream,
    completion_body,
    generate_body,
)


class Server(Protocol):
    """What a generation needs of the engine that runs it."""

    settings: EngineSettings
    stats: Counter[str]
    version: int
    adapters: vllm_lora.Adapters | None
    merger: Merger

    @property
    def http(self) -> GenerationClient:
        """The generation client."""

    async def wait_open(self) -> int:
        """Wait until calls may start; the version the server holds then."""

    async def server_died(self, e: Exception) -> bool:
        """After a failed call: whether to retry it (the server is gone and restarts)."""

    def chunk_running(self) -> contextlib.AbstractAsyncContextManager[None]:
        """Counts a chunk's call as running while it lasts (a load between chunks waits for it)."""


def tokens_left(server: Server, request: GenerateRequest) -> int:
    """The tokens a request may still generate: its cap, within the model's length."""
    return min(request.params.max_new_tokens, server.settings.max_model_len - len(request.prompt_ids))


async def whole(server: Server, request: GenerateRequest) -> GenerateResponse:
    """One streamed call; the server's final chunk labels token spans with weight versions."""
    max_tokens = tokens_left(server, request)
    if max_tokens <= 0:
        return GenerateResponse([], [], [], "length")

    async def call(n: int) -> list[GenerateResponse]:
        while True:
            body = generate_body(request, max_tokens, await server.wait_open(), n)
            stream = GenerateStream(n)
            try:
                async for line in server.http.lines(GENERATE_PATH, body):
                    server.stats["tokens"] += stream.feed(line)
            except CallError as e:
                if await server.server_died(e):
                    continue
                raise
            server.stats.update(events=stream.events, calls=1)
            return stream.responses()

    return await server.merger.one(merge_key(request, request.prompt_ids, max_tokens), call)


async def on_adapter(server: Server, request: GenerateRequest) -> GenerateResponse:
    """LoRA: one completion call on the adapter newest when it starts; every token carries its version
    (the base, before any adapter: version 0)."""
    adapters = server.adapters
    assert adapters is not None
    max_tokens = tokens_left(server, request)
    if max_tokens <= 0:
        return GenerateResponse([], [], [], "length")

    async def call(n: int) -> list[GenerateResponse]:
        reply = None
        while reply is None:
            await server.wait_open()
            version = adapters.acquire()
            body = completion_body(request, request.prompt_ids, max_tokens, 0, n)
            body["model"] = SERVED_NAME if version is None else vllm_lora.name(version)
            try:
                reply = await completion(server, body)
            finally:
                await adapters.release(version)
        tag = server.version if version is None else version
        return [response(choice, tag) for choice in completions(server, reply)]

    return await server.merger.one(merge_key(request, request.prompt_ids, max_tokens), call)


async def chunks(server: Server, request: GenerateRequest) -> GenerateResponse:
    """Completion calls of up to `chunk_tokens` each until the request's cap, a stop, or the model's
    length; each chunk's tokens carry the version the server held when the chunk started."""
    p, s = request.params, server.settings
    resp = GenerateResponse([], [], [], "length")
    while len(resp.token_ids) < p.max_new_tokens:
        context = request.prompt_ids + resp.token_ids
        n = min(s.chunk_tokens, p.max_new_tokens - len(resp.token_ids), s.max_model_len - len(context))
        if n <= 0:
            break
        chunk = await one_chunk(server, request, context, n)
        resp.token_ids += chunk.token_ids
        resp.logprobs += chunk.logprobs
        resp.versions += chunk.versions
        server.stats["chunks"] += 1
        if chunk.finish_reason == "stop":
            resp.finish_reason = "stop"
            break
    return resp


async def one_chunk(
    server: Server, request: GenerateRequest, context: list[int], max_tokens: int
) -> GenerateResponse:
    """One chunk of `max_tokens` continuing `context`, tagged with the version it started under."""
    done = len(context) - len(request.prompt_ids)

    async def call(n: int) -> list[GenerateResponse]:
        body, reply = completion_body(request, context, max_tokens, done, n), None
        while reply is None:
            version = await server.wait_open()
            async with server.chunk_running():
                reply = await completion(server, body)
        return [response(choice, version) for choice in completions(server, reply)]

    return await server.merger.one(merge_key(request, context, max_tokens), call)


async def completion(server: Server, body: dict) -> dict | None:
    """One completion call's reply; None when the server died and the call is to be made again."""
    try:
        return await server.http.post("/v1/completions", body)
    except CallError as e:
        if await server.server_died(e):
            return None
        raise


def completions(server: Server, reply: dict) -> list[dict]:
    """A completion call's choices, in order; counts the call and its tokens."""
    choices = sorted(reply["choices"], key=lambda c: c["index"])
    server.stats.update(calls=1, tokens=sum(len(c["token_ids"]) for c in choices))
    return choices


def response(choice: dict, version: int) -> GenerateResponse:
    """One completion choice, every token tagged `version`."""
    tokens = choice["token_ids"]
    finish = "stop" if choice["finish_reason"] == "stop" else "length"
    return GenerateResponse(tokens, choice["logprobs"]["token_logprobs"], [version] * len(tokens), finish)


GREEDY_BELOW = 1e-5
"""vLLM samples greedily below this temperature, one completion a call (its `_SAMPLING_EPS`)."""


def merge_key(request: GenerateRequest, context: list[int], max_tokens: int) -> Hashable | None:
    """Calls that may share one (`merge`): the same context, sampling and token cap, sampled (not greedy)
    and with no seed."""
    p = request.params
    if p.seed is not None or p.temperature < GREEDY_BELOW:
        return None
    # every field of the sampling (stop ids as a tuple: hashable), the token cap as the call asks it
    return tuple(context), replace(p, stop_token_ids=tuple(p.stop_token_ids), max_new_tokens=max_tokens)

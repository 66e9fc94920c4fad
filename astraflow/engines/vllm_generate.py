"""The three ways a vLLM engine generates a request, each returning every token with the version of the
weights that sampled it:

- whole: one streamed call to the token-in/token-out endpoint, whose final chunk labels token spans with
  versions (weight sync by pause);
- chunks: completion calls of `chunk_tokens` each, continuing from the prompt plus the tokens so far, so a
  load lands between chunks and each chunk carries the version the server held when it started;
- on an adapter (LoRA): one completion call on the adapter newest when it starts.

A call starts only while the engine lets calls start (`wait_open`), and one that fails because the server
died is retried on its restart (`server_died`).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Protocol

from astraflow.engines import vllm_lora
from astraflow.engines.base import GenerateRequest, GenerateResponse
from astraflow.engines.client import CallError, GenerationClient
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
    while True:
        body = generate_body(request, max_tokens, await server.wait_open())
        stream = GenerateStream()
        try:
            async for line in server.http.lines(GENERATE_PATH, body):
                server.stats["tokens"] += stream.feed(line)
        except CallError as e:
            if await server.server_died(e):
                continue
            raise
        server.stats["events"] += stream.events
        return stream.response()


async def on_adapter(server: Server, request: GenerateRequest) -> GenerateResponse:
    """LoRA: one completion call on the adapter newest when it starts; every token carries its version
    (the base, before any adapter: version 0)."""
    adapters = server.adapters
    assert adapters is not None
    n = tokens_left(server, request)
    if n <= 0:
        return GenerateResponse([], [], [], "length")
    while True:
        await server.wait_open()
        version = adapters.acquire()
        body = completion_body(request, request.prompt_ids, n, 0)
        body["model"] = SERVED_NAME if version is None else vllm_lora.name(version)
        try:
            reply = await server.http.post("/v1/completions", body)
            break
        except CallError as e:
            if not await server.server_died(e):
                raise
        finally:
            await adapters.release(version)
    choice = reply["choices"][0]
    tokens = choice["token_ids"]
    server.stats["tokens"] += len(tokens)
    tag = server.version if version is None else version
    finish = "stop" if choice["finish_reason"] == "stop" else "length"
    return GenerateResponse(tokens, choice["logprobs"]["token_logprobs"], [tag] * len(tokens), finish)


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
        body = completion_body(request, context, n, len(resp.token_ids))
        version = await server.wait_open()
        async with server.chunk_running():
            try:
                reply = await server.http.post("/v1/completions", body)
            except CallError as e:
                if await server.server_died(e):
                    continue
                raise
        choice = reply["choices"][0]
        resp.token_ids += choice["token_ids"]
        resp.logprobs += choice["logprobs"]["token_logprobs"]
        resp.versions += [version] * len(choice["token_ids"])
        server.stats.update(chunks=1, tokens=len(choice["token_ids"]))
        if choice["finish_reason"] == "stop":
            resp.finish_reason = "stop"
            break
    return resp

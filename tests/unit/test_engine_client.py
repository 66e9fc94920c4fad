"""The engines' generation client against a server on 127.0.0.1: replies, streamed lines of any length, and
failures as CallError (what the vLLM engine asks about the server's health for)."""

import asyncio
import json

import pytest
from aiohttp import web

from astraflow.engines.client import CallError, GenerationClient
from astraflow.redis_server import free_port

LONG = "x" * 300_000  # past aiohttp's own line limit (128 KiB)


async def stream(request: web.Request) -> web.StreamResponse:
    reply = web.StreamResponse()
    await reply.prepare(request)
    data = f"data: {json.dumps({'a': 1})}\n\ndata: {LONG}\r\ndata: [DONE]".encode()
    for i in range(0, len(data), 7001):  # lines split across writes
        await reply.write(data[i : i + 7001])
        await asyncio.sleep(0)
    return reply


async def echo(request: web.Request) -> web.Response:
    body = await request.json()
    return web.json_response({"got": body, "auth": request.headers.get("Authorization")})


async def fail(_: web.Request) -> web.Response:
    return web.Response(status=500, text="boom")


async def ok(_: web.Request) -> web.Response:
    return web.Response()


@pytest.fixture
async def url():
    app = web.Application()
    app.router.add_post("/stream", stream)
    app.router.add_post("/echo", echo)
    app.router.add_post("/fail", fail)
    app.router.add_get("/health", ok)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def test_replies_and_streamed_lines_of_any_length_arrive_whole(url):
    client = GenerationClient(url, {"Authorization": "Bearer k"})
    try:
        assert await client.post("/echo", {"n": [1, 2]}) == {"got": {"n": [1, 2]}, "auth": "Bearer k"}
        lines = [line async for line in client.lines("/stream", {})]
        assert lines == ['data: {"a": 1}', "", f"data: {LONG}", "data: [DONE]"]
        assert await client.answers("/health", 2.0)
    finally:
        await client.close()


async def test_an_error_reply_or_a_server_that_is_gone_is_a_call_error(url):
    client = GenerationClient(url)
    gone = GenerationClient(f"http://127.0.0.1:{free_port()}")
    try:
        with pytest.raises(CallError, match="POST /fail: 500"):
            await client.post("/fail", {})
        with pytest.raises(CallError, match="POST /fail: 500"):
            [line async for line in client.lines("/fail", {})]
        with pytest.raises(CallError, match="POST /echo"):
            await gone.post("/echo", {})
        assert not await gone.answers("/health", 2.0)
    finally:
        await client.close()
        await gone.close()

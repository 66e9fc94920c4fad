"""The vLLM engine's HTTP connections against a loopback server that holds generate calls open: more calls
at once than httpx's default pool of 100, and a weight load that goes through while they are all held."""

import asyncio
import json

from astraflow.engines.base import GenerateRequest, SamplingParams
from astraflow.engines.settings import EngineSettings
from astraflow.engines.vllm import VLLMEngine
from astraflow.engines.vllm_server import GENERATE_PATH

CALLS = 150  # past httpx's default limit of 100 connections


class HoldingServer:
    """HTTP/1.1 on 127.0.0.1: each generate call is held until `release` is set, then answered with one
    token labelled with the version the server holds then; control calls are answered at once."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.held = 0
        self.version = "0"
        self.controls: list[str] = []
        self._changed = asyncio.Condition()

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        self._server.close()
        self.release.set()

    async def holding(self, n: int) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self.held == n)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:  # keep-alive: one request after another on this connection
                head = (await reader.readuntil(b"\r\n\r\n")).decode()
                lines = head.split("\r\n")
                method, target, _ = lines[0].split(" ")
                sizes = [int(h.split(":")[1]) for h in lines if h.lower().startswith("content-length:")]
                length = sizes[0] if sizes else 0
                body = json.loads(await reader.readexactly(length)) if length else None
                writer.write(await self._answer(method, target, body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def _answer(self, method: str, target: str, body: dict | None) -> bytes:
        if target == GENERATE_PATH:
            async with self._changed:
                self.held += 1
                self._changed.notify_all()
            await self.release.wait()
            self.held -= 1
            spans = [{"version": self.version, "start": 0, "end": 1}]
            choice = {"token_ids": [1], "logprobs": {"content": [{"logprob": -0.1}]}}
            choice |= {"finish_reason": "length", "weight_versions": spans}
            payload = f"data: {json.dumps({'choices': [choice]})}\n\ndata: [DONE]\n\n".encode()
            kind = "text/event-stream"
        else:
            self.controls.append(f"{method} {target}")
            if target == "/update_weight_version":
                self.version = body["new_version"]
            payload, kind = b"{}", "application/json"
        head = f"HTTP/1.1 200 OK\r\nContent-Type: {kind}\r\nContent-Length: {len(payload)}\r\n\r\n"
        return head.encode() + payload


async def test_more_than_a_hundred_calls_run_at_once_and_a_load_goes_through_while_they_are_held():
    server = HoldingServer()
    settings = EngineSettings(
        type="vllm", model="m", port=await server.start(), vllm={"weight_transfer": "files"}
    )
    engine = VLLMEngine(settings)
    engine._open_clients()
    engine.pause_sync = True  # as after a start on a server with the pause endpoints
    engine._open.set()
    requests = [GenerateRequest([1, i], SamplingParams(max_new_tokens=1)) for i in range(CALLS)]  # unmerged
    calls = [asyncio.create_task(engine.generate(r)) for r in requests]
    try:
        await asyncio.wait_for(server.holding(CALLS), 30)  # all of them reached the server at once

        async def load() -> None:
            await engine.pause()
            await engine.load_weights("/weights/v1", version=1)
            await engine.resume()

        await asyncio.wait_for(load(), 30)  # not queued behind the held calls
        assert server.held == CALLS
        assert server.controls == [
            "POST /pause?mode=keep",
            "POST /collective_rpc",
            "POST /update_weight_version",
            "POST /resume",
        ]
        server.release.set()
        done = await asyncio.wait_for(asyncio.gather(*calls), 30)
        assert [r.versions for r in done] == [[1]] * CALLS  # tokens after the load: the new version
    finally:
        for call in calls:
            call.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        await server.close()
        await engine._http.close()
        await engine._ctl.aclose()

"""What the HTTP client benches share: a stand-in server in a process of its own, which answers each POST
to one path with a fixed JSON reply after a delay (a generation's duration), and rounds that alternate
between the clients measured against it (the machine's noise falls on all)."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from astraflow.redis_server import free_port

T = TypeVar("T")


def serve(port: int, path: str, reply: dict, delay_s: float) -> None:
    import logging

    from aiohttp import web

    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)  # clients that close mid-reply

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        await asyncio.sleep(delay_s)
        return web.json_response(reply)

    async def health(_: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_post(path, answer)
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=port, print=None, handle_signals=False)


def wait_healthy(url: str, timeout_s: float = 20.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError(f"the stand-in server at {url} did not answer within {timeout_s:.0f} s")


async def fan_out(call: Callable[[], Awaitable[object]], calls: int, in_flight: int) -> None:
    """`calls` calls of `call`, at most `in_flight` at a time."""
    gate = asyncio.Semaphore(in_flight)

    async def one() -> None:
        async with gate:
            await call()

    await asyncio.gather(*(one() for _ in range(calls)))


def alternate(
    path: str,
    reply: dict,
    delay_s: float,
    names: list[str],
    measure: Callable[[str, str], T],
    rounds: int,
) -> dict[str, list[T]]:
    """Start the server, warm up with `measure(names[0], url)` (imports, first connections), then `rounds`
    rounds of `measure(name, url)` for each name in turn; the measurements by name."""
    port = free_port()
    server = mp.get_context("spawn").Process(target=serve, args=(port, path, reply, delay_s), daemon=True)
    server.start()
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url)
        measure(names[0], url)
        results: dict[str, list[T]] = {name: [] for name in names}
        for _ in range(rounds):
            for name in names:
                results[name].append(measure(name, url))
        return results
    finally:
        server.terminate()
        server.join(5)

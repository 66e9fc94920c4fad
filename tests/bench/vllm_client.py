"""The vLLM engine's generation client: CPU per call with many calls in flight, aiohttp against httpx.

A RaaS keeps one call in flight per sample (130-250 in the default recipes on vLLM). The server here is a
stand-in for vLLM's completions endpoint in a process of its own: it answers each call after `--delay-ms`
(a generation's duration), so the calls pile up to `--in-flight` at once as they do in a run. Each client
makes `--calls` calls, at most `--in-flight` at a time, and the client process's CPU time is what counts
(the server's is not). Clients:

- `aiohttp`: the engine's generation client (`astraflow/engines/client.py`);
- `httpx`: `httpx.AsyncClient` without a connection cap, the engine's client before (baseline);
- `httpx default`: `httpx.AsyncClient()` as a user would write it (its pool of 100 queues the rest).

Rounds alternate between the clients (the machine's noise falls on all); medians are shown.

    python tests/bench/vllm_client.py [--calls 2000] [--in-flight 256] [--delay-ms 20] [--rounds 3] [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import time

from _smoke import parse

from astraflow.engines.client import GenerationClient
from astraflow.redis_server import free_port

REPLY = {
    "choices": [
        {"token_ids": [1, 2, 3, 4], "logprobs": {"token_logprobs": [-0.1] * 4}, "finish_reason": "length"}
    ]
}
BODY = {
    "model": "policy",
    "prompt": list(range(12)),
    "max_tokens": 4,
    "logprobs": 0,
    "return_token_ids": True,
}


def serve(port: int, delay_s: float) -> None:
    from aiohttp import web

    async def completions(request: web.Request) -> web.Response:
        await request.read()
        await asyncio.sleep(delay_s)
        return web.json_response(REPLY)

    async def health(_: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=port, print=None, handle_signals=False)


async def aiohttp_calls(url: str, calls: int, in_flight: int) -> None:
    client = GenerationClient(url)
    try:
        await fan_out(lambda: client.post("/v1/completions", BODY), calls, in_flight)
    finally:
        await client.close()


async def httpx_calls(url: str, calls: int, in_flight: int, capped: bool) -> None:
    import httpx

    limits = httpx.Limits() if capped else httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(None), limits=limits) as client:

        async def call() -> dict:
            reply = await client.post("/v1/completions", json=BODY)
            reply.raise_for_status()
            return reply.json()

        await fan_out(call, calls, in_flight)


async def fan_out(call, calls: int, in_flight: int) -> None:
    gate = asyncio.Semaphore(in_flight)

    async def one() -> None:
        async with gate:
            assert (await call())["choices"][0]["token_ids"] == [1, 2, 3, 4]

    await asyncio.gather(*(one() for _ in range(calls)))


CLIENTS = {
    "aiohttp": aiohttp_calls,
    "httpx": lambda url, n, k: httpx_calls(url, n, k, capped=False),
    "httpx default": lambda url, n, k: httpx_calls(url, n, k, capped=True),
}


def measure(name: str, url: str, calls: int, in_flight: int) -> tuple[float, float]:
    """(client CPU per call in us, calls per wall second) of one round."""
    cpu, wall = time.process_time(), time.perf_counter()
    asyncio.run(CLIENTS[name](url, calls, in_flight))
    return (time.process_time() - cpu) / calls * 1e6, calls / (time.perf_counter() - wall)


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--in-flight", type=int, default=256)
    p.add_argument("--delay-ms", type=float, default=20.0)
    p.add_argument("--rounds", type=int, default=3)
    a = parse(p, calls=300, in_flight=64, rounds=1)
    port = free_port()
    server = mp.get_context("spawn").Process(target=serve, args=(port, a.delay_ms / 1000), daemon=True)
    server.start()
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url)
        measure("aiohttp", url, min(a.calls, 200), a.in_flight)  # warm-up: imports, first connections
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in CLIENTS}
        for _ in range(a.rounds):
            for name in CLIENTS:
                results[name].append(measure(name, url, a.calls, a.in_flight))
    finally:
        server.terminate()
        server.join(5)
    print(f"{a.calls} calls, {a.in_flight} in flight, {a.delay_ms:.0f} ms each, medians of {a.rounds} rounds")
    print(f"{'client':<14} {'cpu us/call':>12} {'calls/s':>10}")
    cpu = {}
    for name, rows in results.items():
        cpu[name] = statistics.median(r[0] for r in rows)
        print(f"{name:<14} {cpu[name]:>12.0f} {statistics.median(r[1] for r in rows):>10.0f}")
    print(
        f"vllm client: httpx/aiohttp cpu per call {cpu['httpx'] / cpu['aiohttp']:.2f}x, "
        f"httpx default/aiohttp {cpu['httpx default'] / cpu['aiohttp']:.2f}x at {a.in_flight} in flight"
    )


if __name__ == "__main__":
    main()

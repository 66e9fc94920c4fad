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
import statistics
import time

from _smoke import parse
from _stand_in import alternate, fan_out

from astraflow.engines.client import GenerationClient

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


def checked(reply: dict) -> None:
    assert reply["choices"][0]["token_ids"] == [1, 2, 3, 4]


async def aiohttp_calls(url: str, calls: int, in_flight: int) -> None:
    client = GenerationClient(url)

    async def call() -> None:
        checked(await client.post("/v1/completions", BODY))

    try:
        await fan_out(call, calls, in_flight)
    finally:
        await client.close()


async def httpx_calls(url: str, calls: int, in_flight: int, capped: bool) -> None:
    import httpx

    limits = httpx.Limits() if capped else httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(None), limits=limits) as client:

        async def call() -> None:
            reply = await client.post("/v1/completions", json=BODY)
            reply.raise_for_status()
            checked(reply.json())

        await fan_out(call, calls, in_flight)


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--in-flight", type=int, default=256)
    p.add_argument("--delay-ms", type=float, default=20.0)
    p.add_argument("--rounds", type=int, default=3)
    a = parse(p, calls=300, in_flight=64, rounds=1)
    results = alternate(
        "/v1/completions",
        REPLY,
        a.delay_ms / 1000,
        list(CLIENTS),
        lambda name, url: measure(name, url, a.calls, a.in_flight),
        a.rounds,
    )
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

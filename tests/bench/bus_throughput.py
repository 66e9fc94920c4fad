"""Bus throughput: consume + publish_and_ack through astraflow vs raw redis-py, same Redis, same run.

A producer process publishes N entries of 1 KiB; C consumer processes move each to an output stream and
acknowledge it. Raw: pipelined XADD, XREADGROUP COUNT 100 then one pipeline of XADDs and an XACK.
Bus: `Bus.publish_many` with dedup keys, and `Runner` hand-offs (owner-checked, atomic, exactly-once).
Two scenarios: "consume" times the consumers alone on a prefilled input stream (the consume +
publish_and_ack path); "end to end" runs the producer concurrently. Throughput = N / (time until the N-th
output exists). Each round measures both paths back to back, in alternating order (raw first in even
rounds); the rates shown are medians over the rounds, the ratio is the median of the rounds' own ratios
(a shared machine's load shifts between rounds more than within one).

    python tests/bench/bus_throughput.py [--messages 20000] [--consumers 2] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import tempfile
import time

import redis.asyncio as aioredis
from _smoke import parse

from astraflow import redis_server
from astraflow.streams import Bus, Consumer, Out, Runner
from astraflow.streams.settings import RedisSettings, StreamsSettings

PAYLOAD = b"x" * 1024
CHUNK = 100


def bus_for(url: str, run: str) -> Bus:
    return Bus.connect(url, run, RedisSettings(), StreamsSettings(block_ms=100))


async def raw_produce(url: str, run: str, n: int) -> None:
    r = aioredis.Redis.from_url(url, protocol=2)
    for start in range(0, n, CHUNK):
        pipe = r.pipeline(transaction=False)
        for i in range(start, min(n, start + CHUNK)):
            pipe.xadd(f"{run}:in", {"kind": "bench", "uid": str(i), "data": PAYLOAD})
        await pipe.execute()
    await r.aclose()


async def raw_consume(url: str, run: str, name: str, n: int) -> None:
    await gate(url, run)
    r = aioredis.Redis.from_url(url, protocol=2)
    while await r.xlen(f"{run}:out") < n:
        reply = await r.xreadgroup("g", name, {f"{run}:in": ">"}, count=CHUNK, block=100)
        for _, entries in reply or []:
            pipe = r.pipeline(transaction=False)
            for _, fields in entries:
                pipe.xadd(f"{run}:out", fields)
            pipe.xack(f"{run}:in", "g", *[i for i, _ in entries])
            await pipe.execute()
    await r.aclose()


async def bus_produce(url: str, run: str, n: int) -> None:
    bus = bus_for(url, run)
    for start in range(0, n, CHUNK):
        outs = [
            Out(bus.keys.prompts, {"kind": "bench", "uid": str(i), "data": PAYLOAD}, f"in:{i}")
            for i in range(start, min(n, start + CHUNK))
        ]
        await bus.publish_many(outs)
    await bus.close()


async def bus_consume(url: str, run: str, name: str, n: int) -> None:
    await gate(url, run)
    bus = bus_for(url, run)

    async def handle(entry):
        # No dedup key: the owner check already makes a hand-off exactly-once (a retry finds the input
        # acknowledged and writes nothing). Dedup keys guard plain publishes, which have no input.
        return [Out(bus.keys.rollouts, entry.fields)]

    stop = asyncio.Event()
    task = asyncio.create_task(Runner(Consumer(bus, bus.keys.prompts, "g", name), handle, CHUNK).run(stop))
    while await bus.redis.xlen(bus.keys.rollouts) < n:
        await asyncio.sleep(0.01)
    stop.set()
    await task
    await bus.close()


def _proc(fn, *args) -> None:
    asyncio.run(fn(*args))


async def setup(url: str, path: str, run: str, gated: bool) -> str:
    bus = bus_for(url, run)
    out = bus.keys.rollouts if path == "bus" else f"{run}:out"
    await bus.ensure_group(bus.keys.prompts if path == "bus" else f"{run}:in", "g")
    if not gated:
        await bus.redis.set(f"{run}:go", 1)
    await bus.close()
    return out


def measure(url: str, path: str, run: str, n: int, consumers: int, prefill: bool) -> float:
    out = asyncio.run(setup(url, path, run, gated=prefill))
    produce, consume = (bus_produce, bus_consume) if path == "bus" else (raw_produce, raw_consume)
    ctx = mp.get_context("fork")
    producer = ctx.Process(target=_proc, args=(produce, url, run, n))
    if prefill:
        producer.start()
        producer.join()
    procs = [ctx.Process(target=_proc, args=(consume, url, run, f"c{i}", n)) for i in range(consumers)]
    for p in procs:
        p.start()
    time.sleep(0.5)  # consumers started and connected
    if prefill:
        asyncio.run(release(url, run))
    started = time.perf_counter()
    if not prefill:
        producer.start()

    async def wait_done() -> float:
        r = aioredis.Redis.from_url(url, protocol=2)
        while await r.xlen(out) < n:
            await asyncio.sleep(0.005)
        await r.aclose()
        return time.perf_counter()

    finished = asyncio.run(wait_done())
    for p in [producer, *procs]:
        p.join(timeout=60)
    return n / (finished - started)


async def release(url: str, run: str) -> None:
    """Let the waiting consumers go (see `gate`)."""
    r = aioredis.Redis.from_url(url, protocol=2)
    await r.set(f"{run}:go", 1)
    await r.aclose()


async def gate(url: str, run: str) -> None:
    """Wait until `release`: consumers of a prefilled stream start together once the clock runs."""
    r = aioredis.Redis.from_url(url, protocol=2)
    while not await r.exists(f"{run}:go"):
        await asyncio.sleep(0.002)
    await r.aclose()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=20_000)
    ap.add_argument("--consumers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    args = parse(ap, messages=500, rounds=1)
    scenarios = {"consume + publish_and_ack": True, "end to end (producer running)": False}
    results: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        server = redis_server.start(tmp)
        try:
            for r in range(args.rounds):
                for s, (name, prefill) in enumerate(scenarios.items()):
                    for path in ("raw", "bus") if r % 2 == 0 else ("bus", "raw"):
                        run = f"{path}{r}s{s}"
                        rate = measure(server.url, path, run, args.messages, args.consumers, prefill)
                        results.setdefault((name, path), []).append(rate)
        finally:
            server.stop()
    print(
        f"bus throughput: {args.messages} x 1 KiB, {args.consumers} consumer processes, "
        f"median of {args.rounds} rounds, AOF everysec"
    )
    print(f"{'scenario':<32}{'raw msg/s':>12}{'astraflow msg/s':>18}{'ratio':>8}")
    for name in scenarios:
        raw, bus = results[(name, "raw")], results[(name, "bus")]
        ratio = statistics.median(b / a for a, b in zip(raw, bus, strict=True))
        print(f"{name:<32}{statistics.median(raw):>12.0f}{statistics.median(bus):>18.0f}{ratio:>8.2f}")


if __name__ == "__main__":
    main()

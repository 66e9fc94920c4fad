"""What `redis.min_replicas_ack` costs: hand-offs per second with 0 (baseline) vs 1 replica acknowledging
(WAIT after each hand-off), on one machine with a real replica (`REPLICAOF`), same Redis, same run.

Each hand-off is one `publish` of a 1 KiB entry with a dedup key; `--workers` concurrent tasks share the
bus. Modes alternate within each round; the median of the rounds is shown, and the ratio to the baseline.

    python tests/bench/replica_ack.py [--handoffs 2000] [--workers 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import redis
from _smoke import parse

from astraflow import redis_server
from astraflow.streams import Bus, Out
from astraflow.streams.settings import RedisSettings, StreamsSettings

PAYLOAD = b"x" * 1024


async def handoffs_per_s(url: str, acks: int, n: int, workers: int, run: str) -> float:
    bus = Bus.connect(url, run, RedisSettings(min_replicas_ack=acks), StreamsSettings())
    await bus.bootstrap([])
    stream = bus.keys.metrics

    async def worker(w: int) -> None:
        for i in range(w, n, workers):
            await bus.publish(Out(stream, {"kind": "bench", "data": PAYLOAD}, f"bench:{i}"))

    started = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(workers)))
    elapsed = time.perf_counter() - started
    await bus.close()
    return n / elapsed


def start_pair(root: Path) -> tuple[redis_server.RedisServer, redis_server.RedisServer]:
    primary = redis_server.start(root / "primary")
    replica = redis_server.start(root / "replica", password=primary.password)
    c = redis.Redis(port=replica.port, password=replica.password)
    c.config_set("masterauth", primary.password)
    c.replicaof("127.0.0.1", primary.port)
    while c.info("replication").get("master_link_status") != "up":
        time.sleep(0.05)
    c.close()
    return primary, replica


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--handoffs", type=int, default=2000)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    a = parse(p, handoffs=100, workers=4, rounds=1)
    with tempfile.TemporaryDirectory() as tmp:
        primary, replica = start_pair(Path(tmp))
        try:
            results: dict[int, list[float]] = {0: [], 1: []}
            for r in range(a.rounds):
                for acks in (0, 1):
                    run = f"bench-{r}-{acks}"
                    results[acks].append(await handoffs_per_s(primary.url, acks, a.handoffs, a.workers, run))
        finally:  # the primary first: a replica whose primary is up takes 15 s to stop here
            primary.stop()
            replica.stop()
    base = statistics.median(results[0])
    print(f"{'min_replicas_ack':<18}{'hand-offs/s':>12}{'vs 0':>8}")
    for acks, values in results.items():
        rate = statistics.median(values)
        print(f"{acks:<18}{rate:>12.0f}{rate / base:>8.2f}")


if __name__ == "__main__":
    asyncio.run(main())

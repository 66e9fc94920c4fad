"""Redis restarted (kill -9, AOF with fsync always) under load: everyone reconnects, nothing is lost."""

import asyncio
import time
from collections import Counter

import pytest

from astraflow import redis_server
from astraflow.messages import RolloutGroup, decode
from astraflow.streams import Bus, Consumer, Runner
from astraflow.streams.keys import GROUP_DATAFLOW
from tests.integration.conftest import BINARIES
from tests.integration.workers import feed, settings_for, spawn_worker
from tests.redis7 import system_redis

pytestmark = [pytest.mark.integration, pytest.mark.slow]
GROUPS = 200


@pytest.mark.parametrize("kind", list(BINARIES))
async def test_everyone_survives_a_redis_restart(kind, tmp_path):
    binary = system_redis() if kind == "system" else BINARIES[kind]
    server = redis_server.start(tmp_path / "redis", binary=binary, appendfsync="always")
    settings = settings_for(server.url, episode_ms=40)
    bus = Bus.connect(server.url, "it", settings.redis, settings.streams)
    await bus.bootstrap(["policy"])
    workers = [spawn_worker(settings, f"w{i}") for i in range(2)]
    seen: Counter[str] = Counter()

    async def collect(entry):
        seen[decode(entry.fields, RolloutGroup).uid] += 1
        return []

    stop = asyncio.Event()
    collector = asyncio.create_task(
        Runner(Consumer(bus, bus.keys.rollouts, GROUP_DATAFLOW, "collector"), collect, 32).run(stop)
    )

    async def produce():
        for start in range(0, GROUPS, 10):
            await feed(bus, 10, start=start)
            await asyncio.sleep(0.03)

    producer = asyncio.create_task(produce())
    try:
        while len(seen) < GROUPS // 4:
            await asyncio.sleep(0.05)
        server.kill()
        await asyncio.sleep(1.0)
        server = redis_server.start(
            tmp_path / "redis",
            binary=BINARIES[kind],
            port=server.port,
            password=server.password,
            appendfsync="always",
        )
        deadline = time.monotonic() + 60
        while len(seen) < GROUPS and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await producer
        assert sorted(seen) == [f"g{i:06d}" for i in range(GROUPS)]
        assert max(seen.values()) == 1
        assert await bus.redis.xlen(bus.keys.dead) == 0
        assert all(w.poll() is None for w in workers)  # reconnected rather than crashed
    finally:
        stop.set()
        await collector
        for w in workers:
            w.terminate()
        for w in workers:
            w.wait(timeout=30)
        await bus.close()
        server.stop()

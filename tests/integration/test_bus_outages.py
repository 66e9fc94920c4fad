"""The bus while Redis is away or refusing writes: work waits, nothing counts as a failed delivery."""

import asyncio

import pytest
import redis.asyncio as aioredis

from astraflow import redis_server
from astraflow.messages import RolloutGroup, decode
from astraflow.streams import Bus, Consumer, Runner
from astraflow.streams.keys import GROUP_RAAS
from tests.integration.conftest import BINARIES
from tests.integration.test_faults import passthrough, run_until
from tests.integration.workers import feed, rollout_uids, settings_for, spawn_worker, wait_pending

pytestmark = pytest.mark.integration


async def test_handoffs_refused_for_oom_are_waited_out_and_never_dead_letter_prompts(bus, redis_url):
    """A user's run: Redis got `maxmemory` 1 MB for a while, hand-offs failed with OOM replies; the
    prompts went to `dead` as 'never acknowledged' and the RaaS exited. They must simply wait."""
    uids = await feed(bus, 8)
    admin = aioredis.Redis.from_url(redis_url)
    await admin.config_set("maxmemory-policy", "noeviction")
    forward = await passthrough(bus, "w")
    lift: list[asyncio.Task] = []

    async def full_for_a_while() -> None:
        await asyncio.sleep(1.0)
        await admin.config_set("maxmemory", 0)

    async def handle(entry):
        outs = await forward(entry)
        if not lift:  # the first result finds Redis refusing writes: every later call waits with it
            await admin.config_set("maxmemory", 1)
            lift.append(asyncio.create_task(full_for_a_while()))
        return outs

    runner = Runner(Consumer(bus, bus.keys.prompts, GROUP_RAAS, "w"), handle, 4)

    async def all_out():
        return await bus.redis.xlen(bus.keys.rollouts) == len(uids)

    try:
        await run_until(runner, all_out)
    finally:
        await admin.config_set("maxmemory", 0)
        await admin.aclose()
    assert sorted(await rollout_uids(bus)) == sorted(uids)
    assert await bus.redis.xlen(bus.keys.dead) == 0
    assert (await bus.redis.xpending(bus.keys.prompts, GROUP_RAAS))["pending"] == 0
    assert runner.stats["ok"] == len(uids) and runner.stats["released"] == 0


@pytest.mark.slow
async def test_worker_waits_out_a_redis_restart_and_keeps_its_entries(tmp_path):
    """Redis down longer than both the reconnect budget and the lease: the RaaS process waits instead of
    exiting, and the entries it holds are not reclaimed by another consumer just because their idle time
    includes the downtime."""
    server = redis_server.start(tmp_path / "redis", binary=BINARIES["system"], appendfsync="always")
    settings = settings_for(server.url, episode_ms=6_000)
    settings.redis.reconnect_max_s = 0.5  # the one-shot budget: shorter than the outage
    bus = Bus.connect(server.url, "it", settings.redis, settings.streams, wait_out=True)
    await bus.bootstrap(["policy"])
    owner = spawn_worker(settings, "owner")
    stop = asyncio.Event()
    thief = Runner(Consumer(bus, bus.keys.prompts, GROUP_RAAS, "thief"), await passthrough(bus, "thief"), 4)
    running = None
    try:
        uids = await feed(bus, 4)
        await wait_pending(bus, "owner", 4)
        running = asyncio.create_task(thief.run(stop))
        server.kill()
        await asyncio.sleep(8 * settings.streams.lease_ms / 1000)
        server = redis_server.start(
            tmp_path / "redis", binary=BINARIES["system"], port=server.port, password=server.password
        )
        while await bus.call(lambda: bus.redis.xlen(bus.keys.rollouts)) < len(uids):
            await asyncio.sleep(0.1)
        rollouts = [decode(f, RolloutGroup) for _, f in await bus.redis.xrange(bus.keys.rollouts)]
        assert {r.uid: r.raas for r in rollouts} == dict.fromkeys(uids, "owner")
        assert owner.poll() is None  # waited the outage out
        assert thief.stats["ok"] == 0
    finally:
        stop.set()
        owner.terminate()
        owner.wait(timeout=30)
        if running is not None:
            await running
        await bus.close()
        server.stop()

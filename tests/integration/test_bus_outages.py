"""The bus while Redis is away or refusing writes: work waits, nothing counts as a failed delivery."""

import asyncio

import pytest
import redis.asyncio as aioredis

from astraflow.streams import Consumer, Runner
from astraflow.streams.keys import GROUP_RAAS
from tests.integration.test_faults import passthrough, run_until
from tests.integration.workers import feed, rollout_uids

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

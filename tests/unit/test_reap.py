"""The dataflow's dead letters of a RaaS's prompts (`streams.reap`): only entries delivered max_deliveries
times and idle past the lease, never one a live holder still works on, never right after an outage."""

import asyncio

from astraflow.streams import Consumer, Out
from astraflow.streams.consumer import RENEW_LAG_S
from astraflow.streams.keys import GROUP_RAAS
from astraflow.streams.reap import Reaper


async def at_last_delivery(bus, c: Consumer, uid: str):
    """Publish prompt `uid` and have `c` fail it until it holds its last delivery."""
    await bus.publish(Out(bus.keys.prompts, {"uid": uid, "data": b"x"}, uid))
    while True:
        c._next_reclaim = float("inf")  # (its own entries only)
        [entry] = await c.read(1, block_ms=10)
        if entry.deliveries == bus.settings.max_deliveries:
            return entry
        await c.release(entry, "ValueError: again")


async def test_a_live_holder_of_a_last_delivery_is_never_robbed(bus):
    c = Consumer(bus, bus.keys.prompts, GROUP_RAAS, "raas-0")
    last = await at_last_delivery(bus, c, "u0")
    await bus.publish(Out(bus.keys.prompts, {"uid": "u1", "data": b"y"}, "u1"))
    [fresh] = await c.read(1, block_ms=10)
    reaper = Reaper(bus)
    for _ in range(3):  # held past the lease, renewed all along
        await asyncio.sleep(bus.settings.lease_ms / 3000)
        assert await c.renew() == []
        assert await reaper.sweep(bus.keys.prompts) == 0
    await c.release(last, "ValueError: for good")  # the last attempt failed: now it is due
    assert await reaper.sweep(bus.keys.prompts) == 1
    [(_, dead)] = await bus.redis.xrange(bus.keys.dead)
    assert dead[b"reason"].endswith(b"last error: raas-0: ValueError: for good")
    pending = await bus.redis.xpending_range(bus.keys.prompts, GROUP_RAAS, "-", "+", 10)
    assert [p["message_id"].decode() for p in pending] == [fresh.id]  # not due: left to the RaaS


async def test_the_reaper_waits_a_lease_after_redis_was_away(bus):
    c = Consumer(bus, bus.keys.prompts, GROUP_RAAS, "raas-0")
    await c.release(await at_last_delivery(bus, c, "u0"), "ValueError: for good")
    reaper = Reaper(bus)
    bus.failures += 1  # a call failed: idle times may include the outage
    assert await reaper.sweep(bus.keys.prompts) == 0
    await asyncio.sleep(bus.settings.lease_ms / 1000 + RENEW_LAG_S + 0.05)
    assert await reaper.sweep(bus.keys.prompts) == 1

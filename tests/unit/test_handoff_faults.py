"""publish_and_ack is all-or-nothing: a failure injected before or after the step leaves both or neither;
a lost reply never counts a delivery twice."""

import asyncio

import pytest
from redis.exceptions import ConnectionError

from astraflow.errors import BusConnectionError
from astraflow.streams import DUP, OK, Consumer, Out
from astraflow.streams.keys import GROUP_RAAS


class Faulty:
    """Wraps the registered hand-off script: fails once, before sending or after Redis executed it."""

    def __init__(self, script, when: str):
        self.script, self.when, self.armed = script, when, True

    async def __call__(self, keys, args):
        if self.armed and self.when == "before":
            self.armed = False
            raise ConnectionError("connection reset before the command was sent")
        result = await self.script(keys=keys, args=args)
        if self.armed and self.when == "after":
            self.armed = False
            raise ConnectionError("connection reset before the reply arrived")
        return result


async def state(bus):
    outputs = await bus.redis.xlen(bus.keys.rollouts)
    pending = (await bus.redis.xpending(bus.keys.prompts, GROUP_RAAS))["pending"]
    return outputs, pending


@pytest.fixture
async def held(bus):
    await bus.publish(Out(bus.keys.prompts, {"data": b"p"}, "p"))
    consumer = Consumer(bus, bus.keys.prompts, GROUP_RAAS, "c")
    [entry] = await consumer.read(1, block_ms=10)
    return consumer, entry


def result_of(bus, n=2):
    return [Out(bus.keys.rollouts, {"data": f"r{i}".encode()}, f"r{i}") for i in range(n)]


@pytest.mark.parametrize("when", ["before", "after"])
async def test_failure_without_retry_leaves_both_or_neither(bus, held, when):
    consumer, entry = held
    bus._scripts["handoff"] = Faulty(bus._scripts["handoff"], when)
    bus.reconnect_max_s = 0  # surface the failure instead of retrying
    with pytest.raises(BusConnectionError):
        await consumer.complete([(entry, result_of(bus))])
    assert await state(bus) in {(0, 1), (2, 0)}  # neither, or both outputs and the ack
    assert await state(bus) == ((0, 1) if when == "before" else (2, 0))


@pytest.mark.parametrize("when", ["before", "after"])
async def test_retried_handoff_converges_to_exactly_once(bus, held, when):
    consumer, entry = held
    bus._scripts["handoff"] = Faulty(bus._scripts["handoff"], when)
    assert await consumer.complete([(entry, result_of(bus))]) == [OK if when == "before" else DUP]
    assert await state(bus) == (2, 0)


async def test_publish_without_dedup_key_survives_a_lost_reply(bus):
    bus._scripts["handoff"] = Faulty(bus._scripts["handoff"], "after")
    await bus.publish(Out(bus.keys.metrics, {"step": "1"}))
    assert await bus.redis.xlen(bus.keys.metrics) == 1


async def test_a_reclaim_whose_reply_was_lost_counts_one_delivery(bus, held):
    _, entry = held  # its owner is gone: it never renews
    await asyncio.sleep(bus.settings.lease_ms / 1000 + 0.05)
    rescuer = Consumer(bus, bus.keys.prompts, GROUP_RAAS, "rescuer")
    rescuer._since_ms = 0  # (its first read is long past)
    real = bus._scripts["claim"]

    async def lose_the_reclaim_reply(keys, args):
        result = await real(keys=keys, args=args)
        if args[0] == "others" and result[1:]:
            bus._scripts["claim"] = real
            raise ConnectionError("connection reset before the reply arrived")
        return result

    bus._scripts["claim"] = lose_the_reclaim_reply
    got = await rescuer.read(1, block_ms=10) or await rescuer.read(1, block_ms=10)
    assert [(e.id, e.deliveries) for e in got] == [(entry.id, 2)]  # taken, and counted once


async def test_a_hand_off_whose_reply_was_lost_still_counts_as_handed_off(bus):
    """The RaaS heartbeat's `groups` (what `astraflow scale` rates workers by) counts it: a hand-off retried
    after a lost reply (or a WAIT for replicas that timed out) comes back DUP, and was done all the same."""
    from astraflow.streams import Runner

    for i in range(3):
        await bus.publish(Out(bus.keys.prompts, {"uid": f"u{i}".encode()}, f"p{i}"))
    bus._scripts["handoff"] = Faulty(bus._scripts["handoff"], "after")

    async def handle(entry):
        return [Out(bus.keys.rollouts, {"uid": entry.fields["uid"]}, entry.fields["uid"].decode())]

    runner = Runner(Consumer(bus, bus.keys.prompts, GROUP_RAAS, "c"), handle, 1)
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    while await bus.redis.xlen(bus.keys.rollouts) < 3 or runner.held:
        await asyncio.sleep(0.02)
    stop.set()
    await task
    assert runner.stats[DUP] == 1 and runner.handed_off == 3

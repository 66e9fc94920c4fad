"""The feeder's room comes with the settle that freed it: a settle, its usual wake-up, costs it no read."""

from __future__ import annotations

import asyncio

from tests.dataflow_helpers import roll_out
from tests.unit.test_dataflow import make


def count_room_reads(df) -> list[int]:
    reads, room = [], df.store.room

    async def counted(*limits):
        reads.append(1)
        return await room(*limits)

    df.store.room = counted
    return reads


async def settle(df, limits):
    """Read and settle what the RaaS handed back; returns the room the settle read under `limits`."""
    n, items = await df.collector.prepare(1)
    assert n
    return await df.collector.commit(items, limits)


async def test_a_settle_reads_the_room_and_the_next_step_submits_without_reading_it():
    bus, df = make("dataflow.feeder.min_backlog=6")
    await bus.bootstrap(["policy"])
    assert await df.feeder.step() == ("full", 6)
    limits = df.feeder.limits_used
    await roll_out(bus, 4, lambda g, i: float(i % 2))  # 4 prompt groups done: 4 slots free
    room = await settle(df, limits)
    assert room == await df.store.room(*limits)  # what a read would have said
    assert (room.groups, room.ready_full, room.cursor) == (4, False, 6)
    assert await df.collector.commit([], limits) is None  # nothing settled, nothing read

    reads = count_room_reads(df)
    df.feeder.hint(limits, room)
    assert await df.feeder.step() == ("full", 4)
    assert reads == []
    assert await df.feeder.step() == ("full", 0)  # nothing new: read (another replica may have made room)
    assert reads == [1]


async def test_a_submit_that_leaves_room_says_so_and_the_next_step_takes_it():
    bus, df = make("dataflow.feeder.min_backlog=6")
    await bus.bootstrap(["policy"])
    await df.feeder.step()
    limits = df.feeder.limits_used
    await roll_out(bus, 2, lambda g, i: float(i % 2))
    room = await settle(df, limits)  # 2 slots free...
    await roll_out(bus, 2, lambda g, i: float(i % 2))  # ... and 2 more before the feeder steps

    reads = count_room_reads(df)
    df.feeder.hint(limits, room)
    assert await df.feeder.step() == ("ok", 2)  # room left: its loop steps again at once
    assert await df.feeder.step() == ("full", 2)
    assert reads == []
    assert await bus.redis.xlen(bus.keys.prompts) == 10


async def test_a_settles_room_read_before_the_feeders_last_submit_is_not_taken():
    """A settle that ran before the feeder's last submit counts the slots that submit took: taking it
    would submit past the backlog limit (the script refuses it, but after the groups were encoded)."""
    bus, df = make("dataflow.feeder.min_backlog=6")
    await bus.bootstrap(["policy"])
    await df.feeder.step()
    limits = df.feeder.limits_used
    await roll_out(bus, 4, lambda g, i: float(i % 2))
    room = await settle(df, limits)
    df.feeder.hint(limits, room)
    assert await df.feeder.step() == ("full", 4)

    reads = count_room_reads(df)
    df.feeder.hint(limits, room)  # the same read again, late: from before that submit
    assert await df.feeder.step() == ("full", 0)  # what the submit left (none), not the late read
    assert reads == []
    df.feeder.hint((limits[0] + 1, limits[1]), await df.store.room(*limits))  # other limits: not taken
    await df.feeder.step()
    assert reads == [1, 1]  # (one here, one by the step)
    assert await bus.redis.xlen(bus.keys.prompts) == 10


async def test_the_loops_hand_the_settles_room_to_the_feeder():
    bus, df = make("dataflow.feeder.min_backlog=6", "dataflow.feeder.interval_ms=10000")
    await bus.bootstrap(["policy"])
    reads = count_room_reads(df)
    loops = [asyncio.create_task(loop()) for loop in (df._feed, df._collect)]
    try:
        await asyncio.sleep(0.2)
        assert await bus.redis.xlen(bus.keys.prompts) == 6
        first = len(reads)
        await roll_out(bus, 3, lambda g, i: float(i % 2))
        for _ in range(50):
            await asyncio.sleep(0.02)
            if await bus.redis.xlen(bus.keys.prompts) == 9:
                break
        assert await bus.redis.xlen(bus.keys.prompts) == 9  # the settle's room, submitted at once
        assert len(reads) == first  # ... without a read of its own
    finally:
        for task in loops:
            task.cancel()
        await asyncio.gather(*loops, return_exceptions=True)


async def test_in_async_mode_a_version_does_not_wake_the_feeder_in_sync_mode_it_does():
    for mode, woken in (("async", False), ("sync", True)):
        _, df = make(f"trainer.mode={mode}")
        steps = []

        async def barrier_step(block_ms, steps=steps):
            if steps:
                await asyncio.sleep(10)
            steps.append(1)
            return 1  # a version recorded

        df.barrier.step = barrier_step
        following = asyncio.create_task(df._follow_versions())
        await asyncio.sleep(0.05)
        assert df._freed.is_set() is woken and df._taken.is_set() is woken, mode
        assert df._collected.is_set()  # the former is told in both
        following.cancel()
        await asyncio.gather(following, return_exceptions=True)

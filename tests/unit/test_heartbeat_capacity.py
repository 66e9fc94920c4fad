"""What a RaaS heartbeat feeds the backlog: capped, never more than its worker has shown it uses, and only
from the holder of the worker's name (issue 20, item 5)."""

from __future__ import annotations

import time

from astraflow.dataflow.service import Dataflow
from astraflow.launch.build import dataflow_setup
from astraflow.messages import Heartbeat, encode
from astraflow.settings_load import load_settings
from astraflow.streams.names import hold_name, name_key, write_heartbeat
from tests.dataflow_helpers import SMALL_RUN, fake_bus, heartbeat, roll_out, small_dataflow


async def test_a_forged_heartbeat_does_not_inflate_the_backlog():
    bus, df = await small_dataflow("dataflow.feeder.min_backlog=8")
    now = time.time()
    forged = Heartbeat(
        uid="evil", region="x", capacity=100_000, in_flight=0, versions={}, endpoint=None,
        started_at=now, updated_at=now,
    )  # fmt: skip
    await bus.redis.hset(bus.keys.raas("evil"), mapping=encode(forged))  # no name held: not counted
    assert (await df.feeder.limits())[0] == 8
    # Even from the name's holder, only what the worker has shown it uses counts.
    await heartbeat(bus, "w", 100_000)
    df.feeder._pool = (0.0, 0)
    assert (await df.feeder.limits())[0] == 2 * 8
    await df.feeder.step()
    assert await bus.redis.xlen(bus.keys.prompts) == 16


def test_what_a_heartbeat_counts_for_grows_with_what_the_dataflow_collected():
    settings = load_settings(None, [*SMALL_RUN, "dataflow.feeder.max_worker_slots=100"])
    feeder = Dataflow(dataflow_setup(settings), fake_bus(settings), "df").feeder

    def beat(capacity: int, in_flight: int = 0, groups: int = 0) -> Heartbeat:
        return Heartbeat(
            uid="w", region="x", capacity=capacity, in_flight=in_flight, versions={}, endpoint=None,
            started_at=0.0, updated_at=60.0, groups=groups,
        )  # fmt: skip

    def collected(groups: int, over_s: float) -> dict[bytes, bytes]:  # the `completed` hash
        return {b"w": str(groups).encode(), b"w:since": str(1000.0 - over_s).encode()}

    assert feeder.counted(beat(4), {}, 1000.0) == 4  # never more than advertised
    assert feeder.counted(beat(64), {}, 1000.0) == 8  # a new worker: the start allowance
    assert feeder.counted(beat(64), collected(30, 60.0), 1000.0) == 30  # 0.5 groups/s over the 60 s horizon
    assert feeder.counted(beat(64), collected(1, 0.0), 1000.0) == 8  # one group is no rate (10 s at least)
    assert feeder.counted(beat(10**6), collected(10**6, 60.0), 1000.0) == 100  # feeder.max_worker_slots


async def test_what_a_worker_reports_of_its_own_work_counts_for_nothing():
    """The attack: five forgers, each holding its own name and reporting 1,024 slots in flight and
    thousands of groups, raised in-flight prompts from 16 to 5,136. Only collected groups count."""
    bus, df = await small_dataflow("dataflow.feeder.min_backlog=8")
    for i in range(5):
        await heartbeat(bus, f"forger-{i}", 1024, in_flight=1024, groups=10**6)
    assert (await df.feeder.limits())[0] == 2 * 5 * 8  # each at the new worker's allowance


async def test_groups_the_collector_settles_raise_their_workers_count():
    bus, df = await small_dataflow("dataflow.feeder.min_backlog=8", "dataflow.feeder.capacity_horizon_s=600")
    await heartbeat(bus, "raas-sim", 1024)
    await df.feeder.step()
    await roll_out(bus, 8, lambda g, i: float(i % 2))  # (as raas-sim)
    while await df.collector.step(1):
        pass
    await df.collector.completions.flush(force=True)
    assert await bus.redis.hget(bus.keys.completed, "raas-sim") == b"8"
    df.feeder._pool = (0.0, 0)
    assert await df.feeder.pool_slots() == 8 * 600 // 10  # 8 groups in the 10 s least window, over 600 s


async def test_a_heartbeat_is_written_only_by_the_holder_of_its_name(bus):
    fields = {"kind": "x", "data": b"y"}
    assert not await write_heartbeat(bus, "w1", fields, 1000)  # not held by this process
    assert not await bus.redis.exists(bus.keys.raas("w1"))
    async with hold_name(bus, "w1", role="raas"):
        assert await write_heartbeat(bus, "w1", fields, 1000)
        held = await bus.redis.get(name_key(bus, "raas", "w1"))
        assert await bus.redis.hget(bus.keys.raas("w1"), "holder") == held
        await bus.redis.set(name_key(bus, "raas", "w1"), "someone else")  # taken over
        assert not await write_heartbeat(bus, "w1", fields, 1000)

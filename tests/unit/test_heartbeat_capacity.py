"""What a RaaS heartbeat feeds the backlog: capped, never more than its worker has shown it uses, and only
from the holder of the worker's name (issue 20, item 5)."""

from __future__ import annotations

import time

from astraflow.config import load_settings
from astraflow.dataflow.service import Dataflow
from astraflow.launch.build import dataflow_setup
from astraflow.messages import Heartbeat, encode
from astraflow.streams.names import hold_name, name_key, write_heartbeat
from tests.dataflow_helpers import SMALL_RUN, fake_bus, heartbeat, small_dataflow


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


def test_what_a_heartbeat_counts_for_grows_with_what_its_worker_shows():
    settings = load_settings(None, [*SMALL_RUN, "dataflow.feeder.max_worker_slots=100"])
    feeder = Dataflow(dataflow_setup(settings), fake_bus(settings), "df").feeder

    def beat(capacity: int, in_flight: int = 0, groups: int = 0, uptime_s: float = 60.0) -> Heartbeat:
        return Heartbeat(
            uid="w", region="x", capacity=capacity, in_flight=in_flight, versions={}, endpoint=None,
            started_at=0.0, updated_at=uptime_s, groups=groups,
        )  # fmt: skip

    assert feeder.counted(beat(4)) == 4  # never more than advertised
    assert feeder.counted(beat(64)) == 8  # a new worker: the start allowance
    assert feeder.counted(beat(64, in_flight=20)) == 40  # twice what it holds
    assert feeder.counted(beat(64, groups=30)) == 30  # 0.5 groups/s over the 60 s horizon
    assert feeder.counted(beat(10**6, in_flight=10**6)) == 100  # feeder.max_worker_slots


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

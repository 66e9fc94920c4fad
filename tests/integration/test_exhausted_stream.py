"""A stream whose ids someone exhausted (issue 41: one `XADD rollouts 18446744073709551615-...` made every
later hand-off fail, and 1,155 groups were dead-lettered in 60 s): the hand-off's failure is waited out
like a Redis that refuses writes for now, never blamed on the entry, so no group dies of it, and once an
admin repaired the stream the same hand-off goes through."""

from __future__ import annotations

import pytest

from astraflow.errors import BusConnectionError
from astraflow.streams import Consumer, Out
from astraflow.streams.keys import GROUP_DATAFLOW, GROUP_RAAS
from astraflow.streams.repair import repair
from astraflow.streams.strays import Strays
from astraflow.streams.views import inspect_run

pytestmark = pytest.mark.integration
LAST = "18446744073709551615-18446744073709551615"


@pytest.mark.parametrize("stream", ["rollouts", "dead"])
async def test_an_exhausted_stream_is_waited_out_and_the_group_survives_its_repair(bus, stream):
    await bus.bootstrap(["policy"])
    key = getattr(bus.keys, stream)
    await bus.redis.xadd(key, {"uid": "forged"}, id=LAST)
    await bus.redis.xadd(bus.keys.prompts, {"uid": "u0", "data": b"p"})
    raas = Consumer(bus, bus.keys.prompts, GROUP_RAAS, "raas")
    [entry] = await raas.read(1, block_ms=10)
    bus.reconnect_max_s = 1.0  # (a worker waits for ever; this test a second)
    out = Out(key, {"uid": "u0", "data": b"r"}, "rollout:u0")
    with pytest.raises(BusConnectionError, match="exhausted the last possible ID"):
        await raas.complete([(entry, [out])])
    # What an admin does (docs/security.md): drop the forged entry, set the stream's last id back.
    await bus.redis.xdel(key, LAST)
    await bus.redis.execute_command("XSETID", key, "0-1")
    if stream == "rollouts":
        await bus.redis.execute_command("XGROUP", "SETID", key, GROUP_DATAFLOW, "0-1")
    assert await raas.complete([(entry, [out])]) == ["ok"]
    assert (await bus.redis.xpending(bus.keys.prompts, GROUP_RAAS))["pending"] == 0


@pytest.mark.parametrize("stream", ["rollouts", "dead"])
async def test_the_dataflow_repairs_a_stream_whose_ids_were_pushed_past_the_present(bus, stream):
    """What the admin had to do by hand, the dataflow does every trim interval: the forged entries go
    (acknowledged in its group), the stream's and the group's last ids go back, and the waiting hand-off
    goes through; an intact stream is left alone."""
    await bus.bootstrap(["policy"])
    key = getattr(bus.keys, stream)
    real = (await bus.redis.xadd(key, {"uid": "real"})).decode()
    await bus.redis.xadd(key, {"uid": "forged"}, id=LAST)
    if stream == "rollouts":  # both delivered to the dataflow: its last delivered id is the largest
        await bus.read(key, GROUP_DATAFLOW, "df", 10, None)
    await bus.redis.xadd(bus.keys.prompts, {"uid": "u0", "data": b"p"})
    raas = Consumer(bus, bus.keys.prompts, GROUP_RAAS, "raas")
    [entry] = await raas.read(1, block_ms=10)
    assert await repair(bus, bus.keys.prompts) == 0  # (intact)
    assert await repair(bus, key) == 1
    assert [i.decode() for i, _ in await bus.redis.xrange(key)] == [real]
    out = Out(key, {"uid": "u0", "data": b"r"}, "rollout:u0")
    assert await raas.complete([(entry, [out])]) == ["ok"]
    if stream == "rollouts":
        assert (await bus.redis.xpending(key, GROUP_DATAFLOW))["pending"] == 1  # the real one only
        [handed] = await bus.read(key, GROUP_DATAFLOW, "df", 10, None)
        assert handed.fields["uid"] == b"u0"  # the hand-off's entry is delivered next
    assert await repair(bus, key) == 0


async def test_inspect_shows_a_stream_whose_group_delivered_the_last_possible_id(bus):
    """`astraflow inspect` failed on such a stream: counting a group's lag on Redis 6.2 (or where 7.x does
    not tell it) reads after its last delivered id, and after the largest id there is no 'after'."""
    await bus.redis.xadd(bus.keys.rollouts, {"uid": "forged"}, id=LAST)
    await bus.read(bus.keys.rollouts, GROUP_DATAFLOW, "df", 10, None)
    [view] = [v for v in await inspect_run(bus) if v.key == "rollouts"]
    assert [(g.name, g.pending, g.lag) for g in view.groups] == [(GROUP_DATAFLOW, 1, 0)]


async def test_the_stray_sweep_goes_on_past_a_group_that_delivered_the_last_possible_id(bus):
    """The sweep read after each tracked stream's last delivered id and failed on this one, every time:
    a stranded group was never settled."""
    await bus.redis.xadd(bus.keys.rollouts, {"uid": "forged"}, id=LAST)
    await bus.read(bus.keys.rollouts, GROUP_DATAFLOW, "df", 10, None)
    await bus.redis.sadd(bus.keys.in_flight, "u0")  # in flight, no entry behind it
    strays = Strays(bus, grace_ms=0)
    await strays.sweep(now=0.0)
    assert await strays.sweep(now=1e6) == ["u0"]

"""Plain fields are for people: an entry whose plain `uid` names a live group, but whose `data` does not,
neither settles nor backs that group - in the collector's dead-lettering, in claim.lua's, nor in the
stray sweep - nor shows in its trace (issue 41, item 3)."""

from __future__ import annotations

from astraflow.messages import SCHEMA_VERSION
from astraflow.ops.audit import read_trace, render_trace
from astraflow.streams.keys import GROUP_DATAFLOW
from astraflow.streams.strays import Strays
from tests.dataflow_helpers import roll_out
from tests.unit.test_dataflow import ledger_of, make


def forged(uid: bytes) -> dict[str, bytes]:
    """An undecodable rollout whose plain `uid` names `uid` (what a worker with the RaaS's credential can
    XADD)."""
    return {"kind": b"rollout_group", "schema": str(SCHEMA_VERSION).encode(), "uid": uid, "data": b"\xc1junk"}


async def live_group(bus, df) -> bytes:
    await bus.bootstrap(["policy"])
    await df.feeder.step()
    return sorted(await bus.redis.smembers(bus.keys.in_flight))[0]


async def test_an_undecodable_entry_naming_a_live_group_leaves_it_alone():
    bus, df = make("dataflow.feeder.min_backlog=2")
    victim = await live_group(bus, df)
    await bus.redis.xadd(bus.keys.rollouts, forged(victim))
    await roll_out(bus, 2, lambda g, i: float(i % 2))  # the real rollouts, after the forged one
    while await df.collector.step(1):
        pass
    [(_, dead)] = await bus.redis.xrange(bus.keys.dead)
    assert b"not valid msgpack" in dead[b"reason"]
    ledger = await ledger_of(bus, df)
    # Both real rollouts were collected; nothing counted dead or unknown.
    assert (ledger.collected, ledger.dead, ledger.unknown, ledger.in_flight) == (2, 0, 0, 0)
    assert ledger.models["policy"].ready == 2
    # ... and the victim's lineage says what happened to it, not what the forged entry claimed.
    trace = render_trace(victim.decode(), await read_trace(bus, victim.decode()), ["policy"])
    assert "ready" in trace and "dead-lettered" not in trace


async def test_claim_dead_letters_a_forged_entry_without_settling_the_group_it_names():
    bus, df = make("dataflow.feeder.min_backlog=1", "streams.max_deliveries=1")
    victim = await live_group(bus, df)
    await bus.redis.xadd(bus.keys.rollouts, forged(victim))
    await bus.read(bus.keys.rollouts, GROUP_DATAFLOW, "crashed", 10, None)  # delivered, never acknowledged
    # A consumer started after the delivery: its own claim counts it, and at max_deliveries it is dead.
    _, claimed = await bus.claim(
        bus.keys.rollouts, GROUP_DATAFLOW, "crashed", mode="own", start="-", count=10, since_ms=2**50
    )
    assert claimed == [] and await bus.redis.xlen(bus.keys.dead) == 1
    assert await bus.redis.smembers(bus.keys.in_flight) == {victim}
    await roll_out(bus, 1, lambda g, i: float(i % 2))
    assert await df.collector.step(1)
    ledger = await ledger_of(bus, df)
    assert (ledger.collected, ledger.dead, ledger.unknown) == (1, 0, 0)


async def test_a_forged_entry_does_not_keep_a_stranded_group_in_flight():
    bus, df = make("dataflow.feeder.min_backlog=1")
    victim = await live_group(bus, df)
    await bus.redis.delete(bus.keys.prompts)  # the group's only entry is gone: stranded
    await bus.bootstrap(["policy"])
    await bus.redis.xadd(bus.keys.rollouts, forged(victim))  # ... but a forged entry names it
    strays = Strays(bus)
    assert await strays.sweep(now=0.0) == []
    assert await strays.sweep(now=1e6) == [victim.decode()]
    assert await bus.redis.smembers(bus.keys.in_flight) == set()

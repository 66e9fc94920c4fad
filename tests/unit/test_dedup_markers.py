"""Dedup markers bound to the hand-off that wrote them, living the lease budget; a prompt group stranded
in flight (no entry left to settle it) dead-lettered after its lease (issue 20, items 4 and 12)."""

from __future__ import annotations

from astraflow.dataflow.ledger import read_ledger
from astraflow.dataflow.service import Dataflow
from astraflow.ops.audit import read_trace
from astraflow.streams import Consumer, Out
from astraflow.streams.keys import GROUP_RAAS
from astraflow.streams.strays import Strays
from tests.dataflow_helpers import roll_out, small_dataflow
from tests.unit.test_bus import fill


async def collect_all(df: Dataflow) -> None:
    while await df.collector.step(1):
        pass


async def test_guessed_dedup_markers_do_not_discard_rollouts():
    bus, df = await small_dataflow("dataflow.feeder.min_backlog=8")
    await df.feeder.step()
    # Group uids are predictable (e<epoch>r<row>): a RaaS credential may write every marker in advance.
    for row in range(50):
        await bus.redis.set(bus.keys.dedup(f"rollout:e0r{row}"), "1-0")
    statuses: dict[str, list[str]] = {}
    uids = await roll_out(bus, 100, lambda g, i: float(i % 2), statuses=statuses)
    assert len(uids) == 8
    assert {s for got in statuses.values() for s in got} == {"ok"}  # not 'dup': nothing was discarded
    assert await bus.redis.xlen(bus.keys.rollouts) == 8
    await collect_all(df)
    ledger = await read_ledger(bus, ["policy"])
    assert (ledger.in_flight, ledger.collected) == (0, 8), ledger.render()


async def test_a_retried_handoff_still_finds_its_own_marker(bus):
    await fill(bus, 1)
    c = Consumer(bus, bus.keys.prompts, GROUP_RAAS, "c")
    [entry] = await c.read(1, block_ms=10)
    out = Out(bus.keys.rollouts, {"uid": "u0", "data": b"r"}, "rollout:u0")
    first = await bus.handoff(bus.keys.prompts, GROUP_RAAS, "c", [(entry, [out])])
    retry = await bus.handoff(bus.keys.prompts, GROUP_RAAS, "c", [(entry, [out])])
    assert [s for s, _ in first + retry] == ["ok", "dup"]
    assert first[0][1] == retry[0][1]  # the retry is told the id the first attempt got
    assert await bus.redis.xlen(bus.keys.rollouts) == 1


async def test_a_stranded_group_unbalances_the_ledger_and_is_dead_lettered_after_its_lease():
    bus, df = await small_dataflow("dataflow.feeder.min_backlog=3")
    await df.feeder.step()
    entries = await bus.read(bus.keys.prompts, GROUP_RAAS, "raas", 1, None)
    stranded = entries[0].fields["uid"].decode()
    # Acknowledged with no rollout (what a 'dup' for a forged marker did): nothing can settle it now.
    await bus.redis.xack(bus.keys.prompts, GROUP_RAAS, entries[0].id)
    ledger = await read_ledger(bus, ["policy"])
    assert ledger.stranded == 1
    assert any("stranded" in p for p in ledger.problems()), ledger.render()

    strays = Strays(bus, grace_ms=0)
    assert await strays.sweep(now=0.0) == []  # seen stranded now: not yet past its lease
    assert await strays.sweep(now=bus.settings.lease_ms / 1000 + 1) == [stranded]
    ledger = await read_ledger(bus, ["policy"])
    assert not ledger.problems(), ledger.render()
    assert (ledger.submitted, ledger.in_flight, ledger.dead) == (3, 2, 1)  # the other two: still in flight
    assert "stranded" in (await read_trace(bus, stranded))["dead"]


async def test_the_feeder_dead_letters_stranded_groups_on_its_own():
    bus, df = await small_dataflow("dataflow.feeder.min_backlog=2", "streams.lease_ms=50")
    await df.feeder.step()
    entries = await bus.read(bus.keys.prompts, GROUP_RAAS, "raas", 1, None)
    await bus.redis.xdel(bus.keys.prompts, entries[0].id)  # deleted while pending
    df.feeder.strays.after_s = 0.0  # (grace: none)
    df.feeder.strays._next = 0.0
    await df.feeder.step()  # sees it
    df.feeder.strays._next = 0.0
    await df.feeder.step()  # settles it
    ledger = await read_ledger(bus, ["policy"])
    assert (ledger.dead, ledger.stranded) == (1, 0), ledger.render()


async def test_dedup_markers_live_the_lease_budget_not_a_day(bus):
    await bus.publish(Out(bus.keys.prompts, {"uid": "u", "data": b"x"}, "p"))
    ttl_ms = await bus.redis.pttl(bus.keys.dedup("p"))
    budget = bus.settings.lease_ms * bus.settings.max_deliveries
    assert budget < ttl_ms <= budget + 60_000

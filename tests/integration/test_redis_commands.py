"""What the dataflow's steps cost in Redis commands (those its scripts run included), on a real Redis: the
run's overhead is counted in commands per trained sample, so a step must not cost more as work piles up."""

from __future__ import annotations

import pytest

from astraflow.dataflow import store
from astraflow.dataflow.service import Dataflow
from astraflow.launch.build import dataflow_setup
from astraflow.settings_load import load_settings
from astraflow.streams import Bus
from astraflow.streams.keys import GROUP_TRAINER
from tests.dataflow_helpers import roll_out

pytestmark = pytest.mark.integration
HELD = 30
"""Batches the trainer holds unacknowledged (it acknowledges them once a checkpoint holds them)."""


async def commands(bus: Bus) -> int:
    """Commands Redis ran so far, every one a script ran included (INFO commandstats' calls)."""
    stats = await bus.redis.info("commandstats")
    return sum(int(v["calls"]) for v in stats.values())


async def command_calls(bus: Bus) -> dict[str, int]:
    """Calls Redis ran so far, per command (`script|exists`, `multi`, ...)."""
    stats = await bus.redis.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


async def test_forming_a_batch_costs_the_same_however_many_batches_the_trainer_holds(bus):
    small = ["dataflow.feeder.n_samples=4", "dataflow.batch.size=8", "dataflow.feeder.min_backlog=2"]
    settings = load_settings(None, ["run.name=it", *small])
    df = Dataflow(dataflow_setup(settings), bus, "df")
    batches = bus.keys.batches("policy")
    held = []
    while len(held) < HELD:  # the trainer reads every batch and acknowledges none
        await df.feeder.step()
        await roll_out(bus, 100, lambda g, i: float(i % 2))
        while await df.collector.step(1):
            pass
        while await df.former.step("policy") == "ok":
            pass
        held += await bus.read(batches, GROUP_TRAINER, "trainer-sim", 100, None)
    await df.feeder.step()
    await roll_out(bus, 100, lambda g, i: float(i % 2))
    while await df.collector.step(1):
        pass

    before = await commands(bus)
    for _ in range(10):
        await df.former.step("policy")
    per_step = (await commands(bus) - before - 1) / 10  # less the INFO itself
    # One look at the held batches per step, not one per batch (the old script ran 30 XPENDINGs here).
    assert per_step < HELD / 2, per_step
    assert await bus.redis.hlen(bus.keys.samples("policy")) > 0

    # Acknowledged at last: the next step releases their groups' bytes, as before.
    await bus.redis.xack(batches, GROUP_TRAINER, *[e.id for e in held])
    await df.former.step("policy")
    refs = await bus.redis.hgetall(bus.keys.refs("policy"))
    assert await bus.redis.zcard(bus.keys.formed("policy")) <= 1  # at most the batch just formed
    assert len(refs) <= 2, refs  # that batch's two groups


async def test_a_look_at_a_run_with_many_keys_takes_a_few_round_trips(bus):
    """The launcher's view reads the run's streams and the RaaS heartbeats every few seconds, and the
    feeder the heartbeats every second; a run keeps a trace per prompt group (tens of thousands)."""
    from astraflow.dataflow.service import Dataflow
    from astraflow.launch.progress import read_heartbeats
    from astraflow.streams.views import inspect_run

    fill = "for i = 1, 20000 do redis.call('SET', ARGV[1] .. i, 1) end"
    await bus.redis.eval(fill, 0, bus.keys.trace_prefix)
    settings = load_settings(None, ["run.name=it", "dataflow.feeder.n_samples=4"])
    feeder = Dataflow(dataflow_setup(settings), bus, "df").feeder

    before = await commands(bus)
    streams = await inspect_run(bus)
    await read_heartbeats(bus)
    await feeder.pool_slots()
    spent = await commands(bus) - before - 1
    assert {v.key for v in streams} >= {"prompts", "rollouts", "versions"}
    assert spent < 60, spent  # at Redis's default SCAN count: over 2,000


@pytest.mark.parametrize("inline_bytes", [store.INLINE_BYTES, 0], ids=["bytes passed", "bytes in a MULTI"])
async def test_settling_rollouts_asks_nothing_about_scripts_and_survives_losing_them(
    bus, monkeypatch, inline_bytes
):
    """A settle is one script call, its groups' bytes passed to it, or (past `INLINE_BYTES`) written by
    plain HSETs in one MULTI with it - where redis-py asked `SCRIPT EXISTS` before each such pipeline, a
    round trip per settle. Either way, a Redis that lost its scripts (restarted) still settles, and the
    samples hash holds the bytes of the groups made ready, and nothing else. The script's commands do not
    grow with the groups it makes ready."""
    monkeypatch.setattr(store, "INLINE_BYTES", inline_bytes)
    first: dict[bool, str] = {}

    def reward(group, i: int) -> float:  # each roll-out's first group: all equal, dropped (zero variance)
        return 1.0 if first.setdefault(flush, group.uid) == group.uid else float(i % 2)

    settings = load_settings(None, ["run.name=it", "dataflow.feeder.n_samples=4"])
    df = Dataflow(dataflow_setup(settings), bus, "df")
    collected = 0
    for flush in (False, True):
        await df.feeder.step()
        uids = await roll_out(bus, 4, reward)
        if flush:
            await bus.redis.script_flush()
        before = await command_calls(bus)
        while await df.collector.step(1):
            pass
        calls = await command_calls(bus)
        assert calls.get("script|exists", 0) == before.get("script|exists", 0)
        in_multi = calls.get("multi", 0) - before.get("multi", 0)
        assert in_multi == (0 if inline_bytes else 1 + flush)  # (again after the NOSCRIPT)
        assert calls["zadd"] - before.get("zadd", 0) == 1  # one settle: one ZADD for its 3 groups
        collected += len(uids) - 1
        ready = await bus.redis.zrange(bus.keys.ready("policy"), 0, -1)
        assert len(ready) == collected
        held = {m.split()[-1] for m in ready}
        assert set(await bus.redis.hkeys(bus.keys.samples("policy"))) == held

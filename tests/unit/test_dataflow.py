"""The dataflow's policies, one at a time, on fakeredis with a simulated RaaS pool and trainer."""

from __future__ import annotations

import asyncio
import time

import fakeredis
import numpy as np
import pytest

from astraflow.dataflow import service
from astraflow.dataflow.ledger import read_ledger
from astraflow.dataflow.service import Dataflow
from astraflow.dataflow.settings import DataflowSettings
from astraflow.dataflow.verdicts import advantages
from astraflow.launch.build import dataflow_setup
from astraflow.messages import SCHEMA_VERSION, RolloutGroup, VersionNotice, decode, encode
from astraflow.ops.audit import read_trace, render_trace
from astraflow.settings_load import load_settings
from astraflow.streams import Bus, Consumer, Keys, Out
from astraflow.streams.keys import GROUP_DATAFLOW, GROUP_RAAS
from astraflow.streams.records import RolloutStats, decode_record, encode_record
from astraflow.streams.runstate import MAX_VERSION_STEP
from astraflow.streams.strays import Strays
from astraflow.weights.published import newest_published
from tests.dataflow_helpers import heartbeat, publish_version, roll_out, small_dataflow, train, trajectory

BASE = ["run.name=t", "dataflow.feeder.n_samples=4", "dataflow.dataset.size=50", "dataflow.batch.size=8"]
BASE += ["dataflow.trace_every=1"]


def make(*overrides: str, models=("policy",)) -> tuple[Bus, Dataflow]:
    settings = load_settings(None, [*BASE, f"run.models={list(models)}", *overrides])
    server = fakeredis.FakeServer(version=(7, 0))
    client = fakeredis.FakeAsyncRedis(server=server, protocol=2)
    bus = Bus(Keys("t"), settings.streams, client, client, reconnect_max_s=1)
    return bus, Dataflow(dataflow_setup(settings), bus, "df")


async def cycle(bus: Bus, df: Dataflow, reward=lambda g, i: float(i % 2), version=0, feed=True) -> list:
    """Feed, roll out everything, collect, form; returns the batches the trainer got."""
    if feed:
        await df.feeder.step()
    await roll_out(bus, 100, reward, version)
    while await df.collector.step(1):
        pass
    for m in df.settings.models:
        while await df.former.step(m) == "ok":
            pass
    return [b for m in df.settings.models for _, b in await train(bus, m)]


async def ledger_of(bus: Bus, df: Dataflow):
    ledger = await read_ledger(bus, df.settings.models)
    assert not ledger.problems(), ledger.render()
    return ledger


def test_advantages_by_hand():
    r = np.array([1.0, 0.0, 0.0, 1.0])
    assert np.allclose(advantages(r, "group", 0.0), [1, -1, -1, 1])
    assert np.allclose(advantages(r, "leave_one_out", 0.0), [1 - 1 / 3, -2 / 3, -2 / 3, 1 - 1 / 3])
    assert np.allclose(advantages(r, "none", 0.0), r)
    assert np.allclose(advantages(np.array([2.0, 2.0]), "group", 1e-6), [0, 0])
    # Finite rewards whose spread overflows, or advantages past float32: never finite-looking.
    assert not np.isfinite(advantages([1e308, -1e308, 1e308], "group", 1e-6)).any()
    assert not np.isfinite(advantages([1e300, 0.0], "none", 0.0)[0])


async def test_batches_hold_whole_groups_with_normalised_advantages():
    bus, df = make("dataflow.feeder.min_backlog=4")
    run = await bus.bootstrap(["policy"])
    batches = await cycle(bus, df)
    assert len(batches) == 2  # 4 groups x 4 samples, batches of 8 samples
    # The run's nonce is in every batch uid: no batch of another run of this name passes for one of it.
    assert [b.uid for b in batches] == [f"policy:{run.nonce}:1", f"policy:{run.nonce}:2"]
    for b in batches:
        assert [len(g.trajectories) for g in b.groups] == [4, 4]
        for g in b.groups:
            assert np.allclose(g.advantages, [-1, 1, -1, 1], atol=1e-5)  # rewards 0, 1, 0, 1
    ledger = await ledger_of(bus, df)
    assert (ledger.submitted, ledger.models["policy"].trained) == (4, 4)


async def test_batch_size_in_groups_and_prefetch_depth():
    bus, df = make("dataflow.batch.unit=groups", "dataflow.batch.size=3", "dataflow.feeder.min_backlog=12")
    await bus.bootstrap(["policy"])
    await df.feeder.step()
    await roll_out(bus, 100, lambda g, i: float(i % 2))
    await df.collector.step(1)
    statuses = [await df.former.step("policy") for _ in range(3)]
    assert statuses == ["ok", "ok", "full"]  # prefetch 2: the third waits for the trainer
    batches = await train(bus, "policy")
    assert [len(b.groups) for _, b in batches] == [3, 3]
    assert [await df.former.step("policy") for _ in range(3)] == ["ok", "ok", "full"]
    await train(bus, "policy")
    assert await df.former.step("policy") == "wait"  # all 12 groups trained


async def test_stale_groups_are_dropped_at_ingest_and_while_waiting():
    bus, df = make("dataflow.max_staleness_steps=1", "dataflow.feeder.min_backlog=3", "dataflow.batch.size=9")
    await bus.bootstrap(["policy"])
    await df.feeder.step()
    await roll_out(bus, 1, lambda g, i: float(i % 2), version=0)  # fresh at v0
    await df.collector.step(1)
    for v in (1, 2, 3):
        await publish_version(bus, "policy", v)
    await df.barrier.step(1)  # trainer at v3: the v0 group waiting in the ready set is stale now
    await roll_out(bus, 1, lambda g, i: float(i % 2), version=1)  # stale on arrival (3 - 1 > 1)
    await roll_out(bus, 1, lambda g, i: float(i % 2), version=2)  # fine
    await df.collector.step(1)
    assert await df.former.step("policy") == "wait"
    ledger = await ledger_of(bus, df)
    assert ledger.models["policy"].dropped == {"stale_ingest": 1, "stale_wait": 1}
    assert ledger.models["policy"].ready == 1


@pytest.mark.parametrize("order", ["edf", "fifo"])
async def test_a_group_goes_stale_behind_the_batches_formed_before_it(order):
    """Prefetched batches are trained first, a version each: a group that would be trained past the
    staleness bound behind them expires, though the trainer's version alone would let it pass."""
    bus, df = make(
        "dataflow.max_staleness_steps=1",
        "dataflow.feeder.min_backlog=3",
        "dataflow.batch.size=4",  # one group of 4 samples
        "dataflow.batch.prefetch=2",
        f"dataflow.collector.order={order}",
    )
    await bus.bootstrap(["policy"])
    await df.feeder.step()
    await roll_out(bus, 1, lambda g, i: float(i % 2), version=0)
    await df.collector.step(1)
    await publish_version(bus, "policy", 1)
    await df.barrier.step(1)
    assert await df.former.step("policy") == "ok"  # the v0 group, trained at v1: staleness 1
    await roll_out(bus, 1, lambda g, i: float(i % 2), version=0)
    await roll_out(bus, 1, lambda g, i: float(i % 2), version=1)
    await df.collector.step(1)
    # Both are fresh at v1, but the batch formed above is trained first: the next at v2 at the earliest.
    assert await df.former.step("policy") == "ok"
    ledger = await ledger_of(bus, df)
    assert ledger.models["policy"].dropped == {"stale_wait": 1}
    batches = await train(bus, "policy")
    assert [min(int(t.versions.max()) for t in b.groups[0].trajectories) for _, b in batches] == [0, 1]


async def test_edf_takes_earliest_deadlines_fifo_takes_arrivals():
    for order, expected in (("edf", ["e0r1", "e0r2"]), ("fifo", ["e0r0", "e0r1"])):
        bus, df = make(f"dataflow.collector.order={order}", "dataflow.feeder.min_backlog=3")
        df.feeder.row_at = lambda p: p  # no shuffle: uids e0r0, e0r1, e0r2
        await bus.bootstrap(["policy"])
        await publish_version(bus, "policy", 3)
        await df.barrier.step(1)
        await df.feeder.step()
        # Arrival order r0, r1, r2; deadlines (min version + 4) r1, r2, r0.
        for version in (3, 1, 2):
            await roll_out(bus, 1, lambda g, i: float(i % 2), version=version)
            await df.collector.step(1)
        assert await df.former.step("policy") == "ok"
        [(_, batch)] = await train(bus, "policy")
        assert batch.group_uids == expected, order


async def test_replay_mixes_recently_trained_groups_at_the_ratio():
    bus, df = make(
        "dataflow.batch.replay_ratio=0.5", "dataflow.batch.replay_capacity=2", "dataflow.feeder.min_backlog=2"
    )
    await bus.bootstrap(["policy"])
    seen = []
    for _ in range(5):
        for batch in await cycle(bus, df):
            seen.append(batch)
    assert len(seen) >= 4
    first, *rest = seen
    assert first.replayed_uids == []  # nothing trained yet
    trained = set(first.group_uids)
    for b in rest:
        assert len(b.replayed_uids) == 1 and len(b.groups) == 2  # 4 of 8 samples replayed
        assert set(b.replayed_uids) <= trained
        trained |= set(b.group_uids)
    assert await bus.redis.zcard(bus.keys.replay("policy")) == 2  # bounded
    await df.former.step("policy")  # releases what the acknowledged batches held
    assert await bus.redis.hlen(bus.keys.samples("policy")) == 2  # nothing else kept
    ledger = await ledger_of(bus, df)
    assert ledger.models["policy"].replayed == len(seen) - 1


async def test_zero_variance_and_failed_groups_are_dropped_and_counted():
    bus, df = make("dataflow.feeder.min_backlog=3", "dataflow.collector.filters=[drop_truncated]")
    await bus.bootstrap(["policy"])
    await df.feeder.step()
    await roll_out(bus, 1, lambda g, i: 1.0)  # all correct: no signal
    bad = RolloutGroup(uid="", raas="r", version=0, trajectories=[], error="engine died", models=["policy"])
    entries = await bus.read(bus.keys.prompts, "raas", "r", 1, None)
    bad = RolloutGroup(**{**vars(bad), "uid": entries[0].fields["uid"].decode()})
    await bus.handoff(bus.keys.prompts, "raas", "r", [(entries[0], [Out(bus.keys.rollouts, encode(bad))])])
    await roll_out(bus, 1, lambda g, i: float(i % 2))
    await df.collector.step(1)
    ledger = await ledger_of(bus, df)
    assert ledger.models["policy"].dropped == {"zero_variance": 1, "failed": 1}
    assert ledger.models["policy"].ready == 1


async def test_malformed_rollout_is_dead_lettered_and_the_collector_goes_on():
    bus, df = make("dataflow.feeder.min_backlog=2")
    await bus.bootstrap(["policy"])
    await df.feeder.step()
    entries = await bus.read(bus.keys.prompts, "raas", "r", 1, None)
    uid = entries[0].fields["uid"]
    garbage = {"kind": b"rollout_group", "schema": str(SCHEMA_VERSION).encode(), "uid": uid}
    garbage["data"] = b"\xc1not msgpack"
    await bus.handoff(bus.keys.prompts, "raas", "r", [(entries[0], [Out(bus.keys.rollouts, garbage)])])
    await roll_out(bus, 1, lambda g, i: float(i % 2))
    await df.collector.step(1)
    [(_, dead)] = await bus.redis.xrange(bus.keys.dead)
    assert b"not valid msgpack" in dead[b"reason"] and dead[b"field.uid"] == uid
    # Its `data` names no group (the plain `uid` is for people): the group, stranded, is the sweep's.
    strays = Strays(bus)
    await strays.sweep(now=0.0)
    assert await strays.sweep(now=1e6) == [uid.decode()]
    ledger = await ledger_of(bus, df)
    assert (ledger.dead, ledger.collected, ledger.in_flight) == (1, 1, 0)
    trace = await read_trace(bus, uid.decode())
    assert "dead-lettered from in_flight: stranded" in render_trace(uid.decode(), trace, ["policy"])


async def test_without_raas_the_feeder_stops_at_the_capacity_bound():
    bus, df = make("dataflow.feeder.min_backlog=5", "dataflow.feeder.backlog_factor=2")
    await bus.bootstrap(["policy"])
    # The step that fills the room says so: the feeder's loop waits instead of stepping again at once.
    assert await df.feeder.step() == ("full", 5)
    assert await bus.redis.xlen(bus.keys.prompts) == 5
    assert (await df.feeder.step()) == ("full", 0)
    # A RaaS with 6 slots joins: the bound becomes 2 x 6.
    await heartbeat(bus, "w", 6)
    df.feeder._pool = (0.0, 0)  # forget the cached pool size
    for _ in range(5):
        await df.feeder.step()
    assert await bus.redis.xlen(bus.keys.prompts) == 12


async def test_feeder_stops_while_the_ready_sets_are_full():
    bus, df = make("dataflow.feeder.min_backlog=8", "dataflow.feeder.max_ready_batches=1")
    await bus.bootstrap(["policy"])
    await df.feeder.step()
    await roll_out(bus, 8, lambda g, i: float(i % 2))
    _, items = await df.collector.prepare(1)
    room = await df.collector.commit(items, df.feeder.limits_used)  # 8 groups ready (32 samples)
    assert (room.groups, room.ready_full) == (0, True)  # (the settle says so; a batch holds 8 samples)
    # No settle makes room now, only the former taking groups out: the feeder waits for it to say so.
    assert (await df.feeder.step()) == ("ready", 0)
    took = []
    df.former.took = lambda: took.append(1)
    assert await df.former.step("policy") == "ok"
    assert took == [1]


async def test_ready_groups_short_of_samples_do_not_stop_the_feeder():
    """Batches in samples: groups that lost samples (a RaaS drops those its reward failed on) fill the
    ready sets' count of groups while holding less than a batch. The feeder must go on, or no batch
    forms and the run stalls."""
    bus, df = make("dataflow.feeder.min_backlog=2", "dataflow.feeder.max_ready_batches=1")
    await bus.bootstrap(["policy"])
    assert (await df.feeder.step())[1] == 2
    await roll_out(bus, 2, lambda g, i: None if i == 0 else float(i % 2))
    await df.collector.step(1)  # 2 groups of 3 samples ready: a batch holds 8
    assert await bus.redis.zcard(bus.keys.ready("policy")) == 2
    assert await df.former.step("policy") == "wait"
    assert await df.feeder.step() == ("full", 2)


async def test_a_model_short_of_a_batch_keeps_the_feeder_going():
    """Two policies, batches of 8 samples, one batch's worth each: the ready sets hold 16 samples
    together, but all of them the first model's (the other's parts were dropped). Stopping would leave
    the second model's former waiting on the feeder for good: the sets are full only once each holds a
    batch."""
    bus, df = make("dataflow.feeder.max_ready_batches=1", models=("a", "b"))
    await bus.bootstrap(["a", "b"])
    await bus.redis.zadd(bus.keys.ready("a"), {f"g{i} 0 4 r{i}": 1 for i in range(4)})
    room = await df.store.room(8, 16)
    assert (room.groups, room.ready_full) == (8, False)
    await bus.redis.zadd(bus.keys.ready("b"), {f"h{i} 0 4 s{i}": 1 for i in range(2)})
    room = await df.store.room(8, 16)
    assert (room.groups, room.ready_full) == (0, True)


async def test_the_feeder_waits_for_the_former_not_for_settles_while_the_ready_sets_are_full():
    """A settle wakes a feeder whose backlog is full, not one whose ready sets are: only the former
    taking groups out of them (or a new version) makes room then."""
    _, df = make("dataflow.feeder.interval_ms=10000")
    statuses, steps = ["ready", "full"], []

    async def step():
        steps.append(1)
        return statuses.pop(0) if statuses else "full", 0

    df.feeder.step = step
    feeding = asyncio.create_task(df._feed())
    try:
        await asyncio.sleep(0.05)
        df._settled(None, feeding)  # a settle: nothing for a feeder waiting on full ready sets
        await asyncio.sleep(0.05)
        assert len(steps) == 1
        df.former.took()  # a batch formed
        await asyncio.sleep(0.05)
        assert len(steps) == 2  # ... and now 'full' (the backlog): a settle wakes it
        df._settled(None, feeding)
        await asyncio.sleep(0.05)
        assert len(steps) == 3
    finally:
        feeding.cancel()


async def test_a_settle_wakes_the_former_only_once_a_batch_may_form():
    """The former's last step found 2 groups missing: settles that made fewer ready leave it asleep."""
    _, df = make("dataflow.batch.unit=groups")
    settle = asyncio.get_running_loop().create_future()
    settle.set_result(None)
    df.former.short["policy"] = 2
    df.former.made_ready("policy", 8)
    df._settled(None, settle)
    assert not df._collected.is_set()
    df.former.made_ready("policy", 8)
    df._settled(None, settle)
    assert df._collected.is_set()
    df._collected.clear()
    df.former.full_until["policy"] = time.monotonic() + 60  # (its prefetch was full)
    df._settled(None, settle)
    assert not df._collected.is_set()


async def test_replicas_share_one_cursor_and_each_epoch_covers_every_row_once():
    bus, df = make("dataflow.feeder.min_backlog=1000", "dataflow.dataset.size=20")
    other = Dataflow(df.settings, bus, "df-2")
    await bus.bootstrap(["policy"])
    for _ in range(2):
        await df.feeder.step()
        await other.feeder.step()
    uids = [f[b"uid"].decode() for _, f in await bus.redis.xrange(bus.keys.prompts)]
    assert len(uids) == len(set(uids)) >= 40
    for epoch in (0, 1):
        rows = sorted(int(u.split("r")[1]) for u in uids if u.startswith(f"e{epoch}r"))
        assert rows == list(range(20))
    orders = [[u for u in uids if u.startswith(f"e{e}r")] for e in (0, 1)]
    assert orders[0] != orders[1]  # reshuffled each epoch


async def test_filter_solved_skips_prompts_that_are_solved():
    bus, df = make(
        "dataflow.feeder.curator=filter_solved",
        "dataflow.dataset.size=4",
        "dataflow.feeder.min_backlog=4",
        "dataflow.feeder.solved_alpha=1.0",
    )
    await bus.bootstrap(["policy"])
    solved = {0, 1}
    reward = lambda g, i: 1.0 if int(g.uid.split("r")[1]) in solved else float(i % 2)  # noqa: E731
    await cycle(bus, df, reward)
    await df.feeder.step()  # from epoch 1 on, rows 0 and 1 are skipped
    uids = [f[b"uid"].decode() for _, f in await bus.redis.xrange(bus.keys.prompts)]
    assert sorted(u for u in uids if u.startswith("e1")) == ["e1r2", "e1r3"]
    assert not [u for u in uids if not u.startswith("e0") and u.split("r")[1] in ("0", "1")]
    assert (await ledger_of(bus, df)).skipped >= 2


async def test_greso_submits_always_solved_prompts_less_and_less():
    bus, df = make(
        "dataflow.feeder.curator=greso",
        "dataflow.dataset.size=20",
        "dataflow.feeder.min_backlog=20",
        "dataflow.batch.size=1000",  # nothing is formed; only the feeding matters
        "dataflow.feeder.max_ready_batches=100",
    )
    await bus.bootstrap(["policy"])
    easy = set(range(10))
    row = lambda g: int(g.uid.split("r")[1])  # noqa: E731
    reward = lambda g, i: 1.0 if row(g) in easy else float(i % 2)  # noqa: E731
    version = 0
    for _ in range(40):  # 40 rounds of ~one epoch each, a version per round
        await df.feeder.step()
        await roll_out(bus, 100, reward)
        while await df.collector.step(1):
            pass
        version += 1
        await publish_version(bus, "policy", version)
        await df.barrier.step(1)
    uids = [f[b"uid"].decode() for _, f in await bus.redis.xrange(bus.keys.prompts)]
    epoch_of = lambda u: int(u[1:].split("r")[0])  # noqa: E731
    last = max(map(epoch_of, uids))  # the last epoch may be partly fed: left out
    late = [u for u in uids if last // 2 <= epoch_of(u) < last]
    n_epochs = last - last // 2
    easy_rate = sum(int(u.split("r")[1]) in easy for u in late) / (10 * n_epochs)
    hard_rate = sum(int(u.split("r")[1]) not in easy for u in late) / (10 * n_epochs)
    assert hard_rate == 1.0  # prompts with a learning signal are always submitted
    assert easy_rate < 0.2  # always-solved ones fall toward the floor (0.05)
    p = await bus.redis.hgetall(bus.keys.curator("greso"))
    # No all-wrong groups at all: p_hard climbs to 1. All-solved ones hold p_easy down near the share
    # where they make up the target 10% of what is collected.
    assert float(p[b"p_hard"]) == 1.0
    assert float(p[b"p_easy"]) < 1.0


async def test_barrier_announces_only_versions_every_model_has_and_flags_eval():
    bus, df = make(models=("solver", "verifier"))
    await bus.bootstrap(["solver", "verifier"])

    async def notices() -> list[VersionNotice]:
        return [decode(f, VersionNotice) for _, f in await bus.redis.xrange(bus.keys.notices)]

    await publish_version(bus, "solver", 0)
    await publish_version(bus, "solver", 1)
    await df.barrier.step(1)
    assert await notices() == []  # the verifier has no version yet
    await publish_version(bus, "verifier", 0)
    await df.barrier.step(1)
    assert [n.version for n in await notices()] == [0]
    await publish_version(bus, "verifier", 1)
    await publish_version(bus, "solver", 2, eval_=True)
    await publish_version(bus, "solver", 3)
    await df.barrier.step(1)
    assert [n.version for n in await notices()] == [0, 1]
    await publish_version(bus, "verifier", 2, eval_=True)
    await publish_version(bus, "verifier", 3)
    await df.barrier.step(1)
    got = await notices()
    assert [(n.version, n.eval) for n in got] == [(0, False), (1, False), (2, True), (3, False)]
    # Each model loads its newest version (a trainer ahead no longer serves the announced one), but
    # never past a pending eval version (served until passed): the solver's 2 with notice 1, not its 3.
    loads = [{"solver": 1, "verifier": 0}, {"solver": 2, "verifier": 1}, {"solver": 2, "verifier": 2}]
    loads.append({"solver": 3, "verifier": 3})
    for n, expected in zip(got, loads, strict=True):
        assert n.models == expected
        assert n.manifests == {m: bus.keys.weights(m, v) for m, v in expected.items()}


async def test_two_models_have_their_own_ready_sets_and_batches():
    bus, df = make("dataflow.feeder.min_backlog=2", models=("solver", "verifier"))
    await bus.bootstrap(["solver", "verifier"])
    batches = await cycle(bus, df)
    assert sorted(b.model for b in batches) == ["solver", "verifier"]
    assert all(len(b.groups) == 2 for b in batches)
    ledger = await ledger_of(bus, df)
    assert ledger.collected == 2 and all(m.trained == 2 for m in ledger.models.values())


async def test_a_policy_not_trained_gets_no_batches_and_its_trajectories_none():
    """A judge (`train: false`) takes part in every episode; only the solver is trained."""
    bus, df = make("run.models={solver: {}, judge: {train: false}}", "dataflow.feeder.min_backlog=2")
    await bus.bootstrap(df.settings.trained)
    await df.feeder.step()
    await roll_out(bus, 100, lambda g, i: float(i % 2))  # trajectories of both policies
    while await df.collector.step(1):
        pass
    while await df.former.step("solver") == "ok":
        pass
    batches = [b for _, b in await train(bus, "solver")]
    assert [len(b.groups) for b in batches] == [2]
    assert {t.model for b in batches for g in b.groups for t in g.trajectories} == {"solver"}
    assert not await bus.redis.exists(bus.keys.batches("judge"), bus.keys.ready("judge"))
    ledger = await read_ledger(bus, df.settings.trained)
    assert not ledger.problems(), ledger.render()
    assert (ledger.collected, list(ledger.models), ledger.models["solver"].trained) == (2, ["solver"], 2)
    assert await bus.redis.xlen(bus.keys.dead) == 0


async def test_a_rollout_for_an_unknown_group_is_acknowledged_not_counted():
    bus, df = make()
    await bus.bootstrap(["policy"])
    stray = RolloutGroup(uid="nobody", raas="r", version=0, trajectories=[trajectory("policy", 1.0, 0)])
    await bus.publish(Out(bus.keys.rollouts, encode(stray)))
    await df.collector.step(1)
    ledger = await ledger_of(bus, df)
    assert (ledger.unknown, ledger.collected) == (1, 0)
    assert await df.collector.step(1) == 0  # acknowledged


async def test_the_rollout_metrics_go_out_with_the_settle_and_a_settle_retried_adds_none():
    """The settle writes the collector's `metrics` entries itself (no round trip of their own), only when
    every entry settles: after a lost reply the same decisions come back settled, and add nothing."""
    bus, df = make()
    await bus.bootstrap(["policy"])
    await df.feeder.step()
    await roll_out(bus, 2, lambda g, i: float(i % 2))
    _, items = await df.collector.prepare(1)
    records = [RolloutStats("policy", 2, 8, 4.0, 1.0)]
    fields = [{k: str(v) for k, v in encode_record(r).items()} for r in records]
    assert (await df.store.collect("df", items, fields)).records_written
    [(_, entry)] = await bus.redis.xrange(bus.keys.metrics)
    assert decode_record(entry) == records[0]
    again = await df.store.collect("df", items, fields)  # (its reply was lost: again)
    assert not again.records_written and [r[0] for r in again.replies] == ["dup", "dup"]
    assert len(await bus.redis.xrange(bus.keys.metrics)) == 1
    await roll_out(bus, 2, lambda g, i: 1.0)
    while await df.collector.step(1):
        pass
    stats = [decode_record(e) for _, e in await bus.redis.xrange(bus.keys.metrics)]
    assert [(r.groups, r.samples, r.reward_sum) for r in stats] == [(2, 8, 4.0), (2, 8, 8.0)]


async def test_a_settle_of_rollouts_this_server_never_delivered_is_lost_and_they_are_read_anew():
    """A promoted replica may lack the collector's read (the group as created, nothing pending): the settle
    answers 'lost' (not 'dup', "settled"), and the rollouts are collected when read again."""
    bus, df = make()
    await bus.bootstrap(["policy"])
    await df.feeder.step()
    await roll_out(bus, 2, lambda g, i: float(i % 2))
    _, items = await df.collector.prepare(1)
    await bus.redis.xgroup_destroy(bus.keys.rollouts, GROUP_DATAFLOW)
    await bus.redis.xgroup_create(bus.keys.rollouts, GROUP_DATAFLOW, "0")
    assert [r[0] for r in (await df.store.collect("df", items)).replies] == ["lost", "lost"]
    while await df.collector.step(1):
        pass
    assert (await ledger_of(bus, df)).collected == 2


@pytest.mark.parametrize("bad", [{"model": "other"}, {"uid": "has space"}])
async def test_rollouts_that_do_not_belong_to_the_run_are_dead_lettered(bad):
    bus, df = make()
    await bus.bootstrap(["policy"])
    traj = trajectory(bad.get("model", "policy"), 1.0, 0)
    msg = RolloutGroup(uid=bad.get("uid", "u"), raas="r", version=0, trajectories=[traj])
    await bus.publish(Out(bus.keys.rollouts, encode(msg)))
    await df.collector.step(1)
    [(_, dead)] = await bus.redis.xrange(bus.keys.dead)
    assert dead[b"reason"].startswith(b"DecodeError: ")


async def test_a_prompt_group_dead_lettered_by_a_raas_is_settled_in_the_ledger():
    bus, df = make("dataflow.feeder.min_backlog=2")
    await bus.bootstrap(["policy"])
    await df.feeder.step()
    consumer = Consumer(bus, bus.keys.prompts, GROUP_RAAS, "raas-1")
    first, _ = await consumer.read(2, None)
    await consumer.dead_letter(first, "DecodeError: sample: bad")
    await consumer.dead_letter(first, "DecodeError: sample: bad")  # a retry counts nothing twice
    ledger = await ledger_of(bus, df)
    assert (ledger.submitted, ledger.dead, ledger.in_flight) == (2, 1, 1)


@pytest.mark.parametrize("oversubmit", [1, 2])
async def test_sync_mode_submits_one_batch_per_version_and_waits_for_the_next(oversubmit):
    bus, df = make(
        "trainer.mode=sync",
        "dataflow.feeder.min_backlog=100",
        "dataflow.max_staleness_steps=0",
        f"dataflow.feeder.sync_oversubmit={oversubmit}",
    )
    await bus.bootstrap(["policy"])
    assert await df.feeder.step() == ("full", 0)  # no version announced yet
    await publish_version(bus, "policy", 0)
    await df.barrier.step(1)
    notice = decode((await bus.redis.xrange(bus.keys.notices))[-1][1], VersionNotice)
    assert notice.eval  # lockstep: every RaaS loads it before generating
    await df.feeder.step()
    # One batch (8 samples = 2 groups of 4), times the oversubmission for groups dynamic sampling drops.
    assert await bus.redis.xlen(bus.keys.prompts) == 2 * oversubmit
    await roll_out(bus, 100, lambda g, i: float(i % 2))
    await df.collector.step(1)
    assert await df.former.step("policy") == "ok"
    assert await df.feeder.step() == ("full", 0)  # version 0's batch exists
    await train(bus, "policy")
    await publish_version(bus, "policy", 1)
    await df.barrier.step(1)
    await df.feeder.step()
    assert await bus.redis.xlen(bus.keys.prompts) == 4 * oversubmit


async def test_sync_mode_submits_again_what_dynamic_sampling_dropped():
    bus, df = make(
        "trainer.mode=sync", "dataflow.feeder.min_backlog=100", "dataflow.feeder.sync_oversubmit=2"
    )
    await bus.bootstrap(["policy"])
    await publish_version(bus, "policy", 0)
    await df.barrier.step(1)
    await df.feeder.step()
    assert await bus.redis.xlen(bus.keys.prompts) == 4
    # Every group's rewards are equal: all dropped, the batch still needs 2 groups, so 4 go out again.
    await roll_out(bus, 100, lambda g, i: 1.0)
    await df.collector.step(1)
    assert await df.former.step("policy") == "wait"
    await df.feeder.step()
    assert await bus.redis.xlen(bus.keys.prompts) == 8


async def test_traces_are_bounded_by_count_keeping_the_newest():
    bus, df = make("dataflow.trace_max_groups=5", "dataflow.feeder.min_backlog=12")
    await bus.bootstrap(["policy"])
    await df.feeder.step()
    await roll_out(bus, 100, lambda g, i: float(i % 2))
    while await df.collector.step(1):
        pass
    kept = sorted([k.decode() async for k in bus.redis.scan_iter(match=bus.keys.trace("*"))])
    submitted = [decode(f, RolloutGroup).uid for _, f in await bus.redis.xrange(bus.keys.rollouts)]
    assert len(submitted) == 12
    assert kept == sorted(bus.keys.trace(uid) for uid in submitted[-5:])  # the newest five
    assert await read_trace(bus, submitted[-1]) is not None
    assert await read_trace(bus, submitted[0]) is None


@pytest.mark.parametrize("every", [16, 0])
async def test_one_group_in_trace_every_is_traced_for_about_the_runs_working_time(every):
    """Every group left a `trace:<uid>` hash for 7 days: 6,320 of them after 40 s of the default recipe.
    Now one group in `trace_every` (by dataset position; the default 16), for `trace_retention_s` (1 h)."""
    bus, df = make(f"dataflow.trace_every={every}", "dataflow.feeder.min_backlog=40")
    assert DataflowSettings().trace_every == 16
    await bus.bootstrap(["policy"])
    await df.feeder.step()
    await df.feeder.step()
    await roll_out(bus, 100, lambda g, i: float(i % 2))
    while await df.collector.step(1):
        pass
    submitted = [decode(f, RolloutGroup).uid for _, f in await bus.redis.xrange(bus.keys.rollouts)]
    kept = sorted([k.decode() async for k in bus.redis.scan_iter(match=bus.keys.trace("*"))])
    assert len(submitted) == 40
    assert kept == sorted(bus.keys.trace(uid) for uid in (submitted[::16] if every else []))
    assert await bus.redis.zcard(bus.keys.traces) == len(kept)
    for key in kept:
        assert 3500 < await bus.redis.ttl(key) <= 3600
        assert b"collected_at" in await bus.redis.hkeys(key)  # the later steps add to a kept trace


async def test_a_full_prefetch_is_stepped_again_after_a_version_not_at_every_settle(monkeypatch):
    """A full prefetch stays full until a trainer reads a batch, while the collector settles many times a
    step: the former steps again once this replica records a version, or FULL_RECHECK_S later."""
    monkeypatch.setattr(service, "FULL_RECHECK_S", 0.2)
    bus, df = make("dataflow.batch.unit=groups", "dataflow.batch.size=2", "dataflow.feeder.min_backlog=12")
    await bus.bootstrap(["policy"])
    await df.feeder.step()
    await roll_out(bus, 100, lambda g, i: float(i % 2))
    await df.collector.step(1)
    assert [await df.former.step("policy") for _ in range(3)] == ["ok", "ok", "full"]
    assert not df.former.due("policy")  # 8 groups still ready, but no room for them
    await train(bus, "policy")
    df.former.version_recorded()
    assert df.former.due("policy")
    assert [await df.former.step("policy") for _ in range(3)] == ["ok", "ok", "full"]
    assert not df.former.due("policy")
    await asyncio.sleep(0.25)  # no version recorded here (another replica's barrier took it)
    assert df.former.due("policy")


async def test_the_former_steps_again_only_once_the_collector_made_enough_ready():
    """A form step is a script of a dozen Redis commands and the collector settles groups many times a
    batch: after a step the former knows how many units are missing and counts what is made ready."""
    bus, df = make("dataflow.feeder.min_backlog=8", "dataflow.batch.size=12")  # 3 groups of 4 samples
    await bus.bootstrap(["policy"])
    await df.feeder.step()
    assert df.former.due("policy")  # nothing known yet
    assert await df.former.step("policy") == "wait"
    assert not df.former.due("policy")  # 12 samples missing
    for expected in (False, False, True):  # one group at a time: due at the third
        await roll_out(bus, 1, lambda g, i: float(i % 2))
        await df.collector.step(1)
        assert df.former.due("policy") is expected
    await roll_out(bus, 1, lambda g, i: float(i % 2))
    await df.collector.step(1)  # a fourth group: one left over
    assert await df.former.step("policy") == "ok"
    assert not df.former.due("policy")  # the 'ok' said the next batch misses 8 samples: no step to learn it
    await roll_out(bus, 1, lambda g, i: 1.0)  # zero variance: dropped, not made ready
    await df.collector.step(1)
    assert not df.former.due("policy")


async def test_a_version_far_past_the_recorded_one_is_dead_lettered_not_recorded():
    """A forged `versions` entry at v = 10^9 (the trainer's credential, or one password for all) made every
    rollout stale until the time limit: it is refused, and the run goes on at the trainer's versions."""
    bus, df = await small_dataflow()
    await publish_version(bus, "policy", 0)
    await df.barrier.step(1)
    await publish_version(bus, "policy", 10**9)
    await publish_version(bus, "policy", 1)
    await df.barrier.step(1)
    state = await df.store.state()
    assert state.version("policy") == 1 and state.notice == 1
    [(_, dead)] = await bus.redis.xrange(bus.keys.dead)
    assert dead[b"reason"] == b"version 1000000000 of policy is over 64 past the recorded one"
    assert (await newest_published(bus, ["policy"]))["policy"].version == 1  # a follower ignores it too
    await publish_version(bus, "policy", 1 + MAX_VERSION_STEP)  # a step of the bound itself is a step
    await df.barrier.step(1)
    assert (await df.store.state()).version("policy") == 1 + MAX_VERSION_STEP

"""Property test of the dataflow under crashes.

Hypothesis interleaves prompt submission, rollouts arriving with random token versions and rewards, trainer
version bumps, batch formation and training, and kills the dataflow between any two of its Redis calls
(before a command runs, or after it ran with the reply lost); a restart is a new Dataflow object on the
same Redis, under the same name or a new one. After every action the ledger must balance; at the end, and
for every batch: no group trained twice, the staleness bound held when the batch was formed, the batch
took the earliest deadlines (or arrivals) of the ready set, and the replay share follows the ratio.
"""

from __future__ import annotations

import asyncio
import random

import fakeredis
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from astraflow.dataflow import store
from astraflow.dataflow.batches import fetch_batch
from astraflow.dataflow.ledger import read_ledger
from astraflow.dataflow.service import Dataflow
from astraflow.launch.build import dataflow_setup
from astraflow.settings_load import load_settings
from astraflow.streams import Bus, Keys
from tests.dataflow_helpers import publish_version, roll_out, train

MODEL = "policy"
N_SAMPLES = 4


class Crash(BaseException):
    """The dataflow process died (BaseException: no `except Exception` in the code may survive it)."""


class Fuse:
    def __init__(self) -> None:
        self.left: int | None = None
        self.after = False

    def arm(self, calls: int, after: bool) -> None:
        self.left, self.after = calls, after


class CrashingRedis(fakeredis.FakeAsyncRedis):
    """A client whose process dies at the fuse's n-th command: before it runs, or after (reply lost)."""

    fuse: Fuse

    async def execute_command(self, *args, **options):
        fuse = self.fuse
        if fuse.left is not None:
            fuse.left -= 1
            if fuse.left <= 0:
                fuse.left = None
                if fuse.after:
                    await super().execute_command(*args, **options)
                raise Crash
        return await super().execute_command(*args, **options)


def crashing_client(server, fuse: Fuse) -> CrashingRedis:
    client = CrashingRedis(server=server, protocol=2)
    client.fuse = fuse
    return client


ACTIONS = st.lists(
    st.one_of(
        st.tuples(st.just("feed")),
        st.tuples(st.just("raas"), st.integers(1, 5), st.integers(0, 3), st.sampled_from(["mixed", "same"])),
        st.tuples(st.just("collect")),
        st.tuples(st.just("form")),
        st.tuples(st.just("train")),
        st.tuples(st.just("barrier")),
        st.tuples(st.just("crash"), st.integers(1, 4), st.booleans(), st.booleans()),
    ),
    min_size=5,
    max_size=120,
)
SETTINGS = st.fixed_dictionaries(
    {
        "order": st.sampled_from(["edf", "fifo"]),
        "unit": st.sampled_from(["samples", "groups"]),
        "replay_selection": st.sampled_from(["latest", "uniform"]),
        "replay_ratio": st.sampled_from([0.0, 0.25, 0.5]),
        "max_staleness": st.integers(0, 2),
        "bytes_in_multi": st.booleans(),  # a settle's bytes by HSETs in its MULTI, or passed to its script
    }
)


def make_settings(opts: dict):
    size = 2 * N_SAMPLES if opts["unit"] == "samples" else 2
    return load_settings(
        None,
        [
            "run.name=prop",
            f"dataflow.max_staleness_steps={opts['max_staleness']}",
            f"dataflow.feeder.n_samples={N_SAMPLES}",
            "dataflow.feeder.min_backlog=6",
            "dataflow.dataset.size=40",
            f"dataflow.collector.order={opts['order']}",
            "dataflow.collector.read_count=4",
            f"dataflow.batch.size={size}",
            f"dataflow.batch.unit={opts['unit']}",
            f"dataflow.batch.replay_ratio={opts['replay_ratio']}",
            f"dataflow.batch.replay_selection={opts['replay_selection']}",
            "dataflow.batch.replay_capacity=3",
            "dataflow.batch.prefetch=2",
            "streams.lease_ms=1",
            "streams.max_deliveries=4",
        ],
    )


class World:
    """One Redis, the simulated RaaS pool and trainer, and the (re)started dataflow under test."""

    def __init__(self, opts: dict) -> None:
        self.opts = opts
        self.settings = make_settings(opts)
        self.server = fakeredis.FakeServer(version=(7, 0))
        self.fuse = Fuse()
        self.rng = random.Random(0)
        self.obs = self._bus(fakeredis.FakeAsyncRedis(server=self.server, protocol=2))
        self.version = 0  # the simulated trainer's version
        self.batches: list = []
        self.restarts = 0
        self.df = self._dataflow("df-0")

    def _bus(self, client, blocking=None) -> Bus:
        return Bus(Keys("prop"), self.settings.streams, client, blocking or client, reconnect_max_s=1)

    def _dataflow(self, name: str) -> Dataflow:
        bus = self._bus(crashing_client(self.server, self.fuse), crashing_client(self.server, self.fuse))
        return Dataflow(dataflow_setup(self.settings), bus, name)

    def restart(self, same_name: bool) -> None:
        self.restarts += 1
        self.fuse.left = None
        self.df = self._dataflow(self.df.name if same_name else f"df-{self.restarts}")

    async def act(self, action: tuple) -> None:
        kind = action[0]
        if kind == "crash":
            _, calls, after, same_name = action
            self.fuse.arm(calls, after)
            self.pending_restart = same_name
            return
        try:
            await self._act(action)
        except Crash:
            self.restart(getattr(self, "pending_restart", True))

    async def _act(self, action: tuple) -> None:
        kind, df = action[0], self.df
        if kind == "feed":
            await df.feeder.step()
        elif kind == "raas":
            _, count, lag, rewards = action
            await roll_out(self.obs, count, self._reward(rewards), max(self.version - lag, 0))
        elif kind == "collect":
            await df.collector.step(1)
        elif kind == "form":
            await self._form()
        elif kind == "train":
            trained = await train(self.obs, MODEL)
            if trained:
                self.version += 1
                await publish_version(self.obs, MODEL, self.version)
        elif kind == "barrier":
            await df.barrier.step(1)

    def _reward(self, kind: str):
        if kind == "same":
            return lambda group, i: 1.0
        return lambda group, i: float(self.rng.random() < 0.5)

    async def _form(self) -> None:
        """One batch formation, checked against the ready and replay sets just before it."""
        k = self.obs.keys
        ready = await self.obs.redis.zrange(k.ready(MODEL), 0, -1, withscores=True)
        replay = await self.obs.redis.zrange(k.replay(MODEL), 0, -1)
        before = await self.obs.redis.xlen(k.batches(MODEL))
        try:
            await self.df.former.step(MODEL)
        finally:
            new = (await self.obs.redis.xrange(k.batches(MODEL)))[before:]
            assert len(new) <= 1
            if new:
                self.check_batch(await fetch_batch(self.obs, new[0][1]), ready, replay)

    def check_batch(self, batch, ready, replay) -> None:
        self.batches.append(batch)
        s, opts = self.settings.dataflow, self.opts
        members = {m.decode().split()[0]: (m.decode(), score) for m, score in ready}
        fresh = [g for g in batch.groups if g.uid not in batch.replayed_uids]
        # Staleness bound at formation.
        for g in fresh:
            assert batch.version - g.min_version <= s.max_staleness_steps, (batch.uid, g.uid)
        # Earliest deadlines (or arrivals) first, among what was still fresh.
        alive = {
            uid: score
            for uid, (member, score) in members.items()
            if batch.version - int(member.split()[1]) <= s.max_staleness_steps
        }
        taken = {g.uid for g in fresh}
        assert taken <= set(alive), "a batch took a group that was not in the ready set"
        if taken and set(alive) - taken:
            assert max(alive[u] for u in taken) <= min(v for u, v in alive.items() if u not in taken)
        # Replay share.
        units = (lambda g: len(g.trajectories)) if opts["unit"] == "samples" else (lambda g: 1)
        quota = round(s.batch.replay_ratio * s.batch.size)
        replayed = [g for g in batch.groups if g.uid in batch.replayed_uids]
        assert {g.uid for g in replayed} <= {m.decode().split()[0] for m in replay}
        got = sum(units(g) for g in replayed)
        available = len(replay) * (N_SAMPLES if opts["unit"] == "samples" else 1)
        assert got >= min(quota, available)
        assert not replayed or got - units(replayed[-1]) < quota


async def scenario(opts: dict, actions: list) -> None:
    world = World(opts)
    await world.df.bus.bootstrap([MODEL])
    for action in actions:
        await world.act(action)
        ledger = await read_ledger(world.obs, [MODEL])
        assert not ledger.problems(), (action, ledger.render())
    # Run on without crashes, then drain: every submitted group ends trained, dropped or dead.
    for rounds in range(60):
        feed = [("feed",)] if rounds < 8 else []
        for action in (*feed, ("raas", 10, 0, "mixed"), ("collect",), ("barrier",), ("form",), ("train",)):
            await world.act(action)
        ledger = await read_ledger(world.obs, [MODEL])
        assert not ledger.problems(), ledger.render()
        if ledger.in_flight == 0:
            break
    assert ledger.in_flight == 0, ledger.render()
    fresh = [g.uid for b in world.batches for g in b.groups if g.uid not in b.replayed_uids]
    assert len(fresh) == len(set(fresh)), "a group was trained twice"
    assert len(fresh) == ledger.models[MODEL].trained
    trained_before = set()
    for b in world.batches:
        assert set(b.replayed_uids) <= trained_before, "replayed a group that was never trained"
        trained_before |= {g.uid for g in b.groups}
    assert ledger.models[MODEL].replayed == sum(len(b.replayed_uids) for b in world.batches)
    # Nothing leaks: once every batch is acknowledged, only the ready and replay sets hold stored groups.
    while await world.df.former.step(MODEL) != "wait":  # the last step releases the acknowledged ones
        await train(world.obs, MODEL)
    k, r = world.obs.keys, world.obs.redis
    held = {m.split()[-1] for key in (k.ready(MODEL), k.replay(MODEL)) for m in await r.zrange(key, 0, -1)}
    assert set(await r.hkeys(k.samples(MODEL))) == held
    assert set(await r.hkeys(k.refs(MODEL))) == held
    event(f"restarts: {min(world.restarts, 3)}+")
    event(f"batches: {min(len(world.batches), 5)}+")
    event(f"dead: {min(ledger.dead, 1)}+")
    event(f"dropped: {min(ledger.models[MODEL].dropped_total, 1)}+")
    event(f"replayed: {min(ledger.models[MODEL].replayed, 1)}+")


@pytest.mark.slow
@pytest.mark.timeout(600)  # 200 crash interleavings: 60 s of CPU, several times that on a loaded machine
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(SETTINGS, ACTIONS)
def test_dataflow_survives_crashes_between_any_two_redis_calls(opts, actions):
    inline = store.INLINE_BYTES
    store.INLINE_BYTES = 0 if opts["bytes_in_multi"] else inline
    try:
        asyncio.run(scenario(opts, actions))
    finally:
        store.INLINE_BYTES = inline

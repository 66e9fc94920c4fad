"""Two dataflow replica processes on a real Redis, one of them killed with SIGKILL and restarted, while
this test plays the RaaS pool and the trainer: the ledger balances, no group is trained twice, every
batch met the staleness bound and the replay ratio; `astraflow ledger` and `astraflow trace` read the run."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from astraflow.config import Settings
from astraflow.dataflow.batches import fetch_batch
from astraflow.dataflow.ledger import read_ledger
from astraflow.dataflow.service import Dataflow
from astraflow.launch.build import dataflow_setup
from astraflow.settings_load import load_settings, to_env
from astraflow.streams import Bus
from astraflow.streams.keys import GROUP_TRAINER
from tests.dataflow_helpers import heartbeat, publish_version, roll_out, train

pytestmark = pytest.mark.integration
MODEL = "policy"


def replica_settings(url: str) -> Settings:
    return load_settings(
        None,
        [
            "run.name=it",
            f"redis.url={url}",
            "streams.lease_ms=1000",
            "streams.block_ms=100",
            "dataflow.max_staleness_steps=2",
            "dataflow.trace_every=1",
            "dataflow.feeder.n_samples=4",
            "dataflow.batch.size=16",
            "dataflow.batch.replay_ratio=0.25",
            "dataflow.batch.replay_capacity=4",
        ],
    )


def spawn(settings: Settings, name: str) -> subprocess.Popen:
    named = settings.model_copy(deep=True)
    named.dataflow.id = name
    env = {**os.environ, **to_env(named)}
    return subprocess.Popen(
        [sys.executable, "-m", "workers.dataflow"],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def cli(url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "astraflow.cli", *args, "--redis", url, "--run", "it"],
        capture_output=True,
        text=True,
        timeout=60,
    )


async def test_two_replicas_one_killed_keep_every_guarantee(bus, redis_url):
    settings = replica_settings(redis_url)
    await heartbeat(bus, "sim", 8)
    replicas = [spawn(settings, "df-a"), spawn(settings, "df-b")]
    rng = random.Random(0)
    version, batches, killed_at = 0, [], None
    try:
        deadline = time.monotonic() + 90
        while len(batches) < 24 and time.monotonic() < deadline:
            lag = rng.randint(0, 3)
            await roll_out(bus, 6, lambda g, i: float(rng.random() < 0.5), max(version - lag, 0))
            got = await train(bus, MODEL)
            batches += [b for _, b in got]
            if got:
                version += 1
                await publish_version(bus, MODEL, version)
            if killed_at is None and len(batches) >= 6:
                replicas[0].send_signal(signal.SIGKILL)  # mid-run, whatever it was doing
                replicas[0].wait()
                killed_at = len(batches)
            elif killed_at is not None and replicas[0].poll() is not None and len(batches) >= killed_at + 6:
                replicas[0] = spawn(settings, "df-a")  # the same name takes back what it held
            await asyncio.sleep(0.01)
        assert len(batches) >= 24, f"only {len(batches)} batches in 90 s"
    finally:
        for p in replicas:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in replicas:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    errors = b"".join(p.stderr.read() for p in replicas if p.stderr)
    assert b"Traceback" not in errors, errors.decode()[-3000:]

    ledger = await read_ledger(bus, [MODEL])
    assert not ledger.problems(), ledger.render()
    fresh = [g.uid for b in batches for g in b.groups if g.uid not in b.replayed_uids]
    assert len(fresh) == len(set(fresh)), "a group was trained twice"
    for b in batches:
        for g in b.groups:
            if g.uid not in b.replayed_uids:
                assert b.version - g.min_version <= 2, (b.uid, g.uid, g.min_version)
    for b in batches[1:]:
        assert len(b.replayed_uids) == 1  # 4 of 16 samples: one group of 4

    result = cli(redis_url, "ledger", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(result.stdout)["balanced"]
    uid = fresh[0]
    result = cli(redis_url, "trace", uid)
    assert result.returncode == 0, result.stderr
    assert f"prompt group {uid}" in result.stdout and "trained in batch policy:" in result.stdout
    assert "rolled out by raas-sim" in result.stdout


async def test_a_replica_forms_batches_before_any_trainer_has_connected(
    redis_url, redis_settings, streams_settings
):
    """The dataflow is the run's first process (nothing bootstrapped the run, no trainer exists): it
    creates the run's identity and groups itself and forms batches up to its prefetch, which wait in
    the batches stream for the trainer to come."""
    settings = load_settings(
        None, ["run.name=df-first", "dataflow.feeder.n_samples=4", "dataflow.batch.size=8"]
    )
    bus = Bus.connect(redis_url, "df-first", redis_settings, streams_settings)
    stream = bus.keys.batches(MODEL)
    stop = asyncio.Event()
    replica = asyncio.create_task(Dataflow(dataflow_setup(settings), bus, "df-a").run(stop))
    try:
        await heartbeat(bus, "sim", 8)
        deadline = time.monotonic() + 30
        while await bus.redis.xlen(stream) < settings.dataflow.batch.prefetch:
            assert time.monotonic() < deadline, "no batch formed in 30 s"
            assert not replica.done(), replica
            await roll_out(bus, 8, lambda g, i: float(i % 2))  # rewards vary: no group is dropped
            await asyncio.sleep(0.05)
        entries = await bus.redis.xrange(stream)
        batches = [await fetch_batch(bus, fields) for _, fields in entries]
        (group,) = await bus.redis.xinfo_groups(stream)
    finally:
        stop.set()
        await replica
        await bus.close()
    assert all(len(b.groups) == 2 and b.model == MODEL for b in batches)  # 8 samples: 2 groups of 4
    assert group["name"] == GROUP_TRAINER.encode() and group["consumers"] == 0 and group["pending"] == 0

"""The trainer under `kill -9` between publishing a version and checkpointing the next: it resumes from
the right version, trains every batch exactly once in the surviving lineage (checked by batch uid).
Checkpointing every version, it publishes each version once and never announces one its checkpoints do
not hold; checkpointing every 4, it publishes every version, and a restart from an older checkpoint
announces that checkpoint's version again (a rollback) before training the lost ones again."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from astraflow.config import Settings
from astraflow.dataflow.service import Dataflow
from astraflow.launch.build import dataflow_setup
from astraflow.messages import VersionPublished, decode
from astraflow.settings_load import to_env
from astraflow.streams.keys import GROUP_TRAINER
from astraflow.trainer import checkpoint
from tests.dataflow_helpers import heartbeat, roll_out

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.one_redis]
TARGET = 12


def settings_for(url: str, model: str, tmp_path, checkpoint_every: int = 1) -> Settings:
    s = Settings()
    s.run.name, s.run.dir, s.redis.url = "it", tmp_path, url
    s.engine.model = model
    s.streams.lease_ms, s.streams.block_ms = 1000, 100
    s.streams.trim_interval_ms = 10**9  # the trainer keeps `batches:policy` whole, for the test to check
    s.dataflow.feeder.n_samples = 4
    s.dataflow.batch.size = 8
    s.dataflow.max_staleness_steps = 100
    s.trainer.micro_batch_tokens = 256
    s.trainer.max_steps = TARGET
    s.trainer.threads = 1
    s.trainer.checkpoint_every = checkpoint_every
    s.weights.dir = tmp_path / "weights"
    return s


def spawn(settings: Settings) -> subprocess.Popen:
    env = {**os.environ, **to_env(settings)}
    log = open(settings.run.path / "trainer.log", "ab")
    return subprocess.Popen(
        [sys.executable, "-m", "workers.trainer"],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        start_new_session=True,
    )


async def published(bus) -> list[VersionPublished]:
    return [decode(f, VersionPublished) for _, f in await bus.redis.xrange(bus.keys.versions)]


@pytest.mark.parametrize("every", [1, 4])
async def test_trainer_survives_kill_9_between_publish_and_checkpoint(
    bus, redis_url, tiny_model, tmp_path, every
):
    s = settings_for(redis_url, tiny_model, tmp_path, every)
    bus.settings = bus.settings.model_copy(update={"trim_interval_ms": 10**9})  # keep `versions` to check
    await heartbeat(bus, "sim", 8)
    dataflow = Dataflow(dataflow_setup(s), bus, "df", rows=[{"prompt": "1+1=", "answer": "2"}] * 50)
    stop = asyncio.Event()
    df_task = asyncio.create_task(dataflow.run(stop))
    rng = random.Random(0)
    trainer = spawn(s)
    kills = fed = 0
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            versions = await published(bus)
            latest = versions[-1].version if versions else 0
            # at most one batch beyond the newest version: the trainer cannot run ahead of the kill
            if fed // 2 <= latest:
                fed += len(await roll_out(bus, 2, lambda g, i: float(i % 2), 0, tokens=12))
            # past a checkpoint by one or two versions (with every 4), so the restart must roll back
            if kills < 3 and latest >= 2 + 3 * kills and (every == 1 or latest % every in (1, 2)):
                await asyncio.sleep(rng.uniform(0.0, 0.3))  # inside the next step, before its checkpoint
                os.killpg(trainer.pid, signal.SIGKILL)
                trainer.wait()
                kills += 1
                trainer = spawn(s)
            if trainer.poll() is not None:
                break
            await asyncio.sleep(0.05)
        assert trainer.wait(timeout=60) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
    finally:
        if trainer.poll() is None:
            os.killpg(trainer.pid, signal.SIGKILL)
            trainer.wait()
        stop.set()
        await df_task
    assert kills == 3

    announced = await published(bus)
    versions = [v.version for v in announced]
    if every == 1:
        assert versions == list(range(TARGET + 1)), versions  # each version announced once, none skipped
    lineages = [list(g) for _, g in itertools.groupby(announced, key=lambda v: v.incarnation)]
    for lineage in lineages:  # each trainer announces consecutive versions
        assert [v.version for v in lineage] == list(range(lineage[0].version, lineage[-1].version + 1))
    for dead, successor in itertools.pairwise(lineages):  # it goes on, or rolls back to a checkpoint
        first, last = successor[0].version, dead[-1].version
        assert first == last + 1 or (first % every == 0 and first <= last), versions
    assert any(b[0].version <= a[-1].version for a, b in itertools.pairwise(lineages)) == (every > 1)
    assert lineages[-1][-1].version == TARGET
    latest = checkpoint.latest(s.run.path / "checkpoints" / "policy")
    meta = json.loads((latest / "meta.json").read_text())
    assert meta["version"] == TARGET
    consumed = meta["consumed"]
    assert len(consumed) == len(set(consumed)) == TARGET  # no batch trained twice in the lineage
    stream = bus.keys.batches("policy")
    formed = [f[b"uid"].decode() for _, f in await bus.redis.xrange(stream)]
    pending = {p["message_id"] for p in await bus.redis.xpending_range(stream, GROUP_TRAINER, "-", "+", 100)}
    [group] = [g for g in await bus.redis.xinfo_groups(stream) if g["name"] == GROUP_TRAINER.encode()]
    delivered = await bus.redis.xrange(stream, "-", group["last-delivered-id"])
    acked = [f[b"uid"].decode() for i, f in delivered if i not in pending]
    assert set(consumed) <= set(formed)
    assert set(acked) <= set(consumed)  # acknowledged only once trained and checkpointed
    assert consumed == formed[: len(consumed)]  # in order, none skipped

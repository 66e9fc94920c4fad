"""Poison batches against a real trainer process and a real redis-server: a batch with a token id outside
the policy's vocabulary (past a collector that does not know the vocabulary) is refused at its first
attempt, and one whose step raises crashes the trainer twice and is set aside at the third start; each is
dead-lettered with its reason, the ledger counts its groups dead (never trained) and balances, and the
next good batch trains into version 1."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import time
from pathlib import Path

import pytest

from astraflow.dataflow.ledger import read_ledger
from astraflow.dataflow.service import Dataflow
from astraflow.launch.build import dataflow_setup
from astraflow.messages import (
    PromptGroup,
    RolloutGroup,
    SampleGroup,
    VersionPublished,
    decode,
    encode,
    pack,
    unpack,
)
from astraflow.streams import Out
from astraflow.streams.keys import GROUP_RAAS
from tests.dataflow_helpers import heartbeat, trajectory
from tests.integration.test_trainer_crash import settings_for, spawn

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.one_redis]


async def hand_back(bus, count: int, token: int | None = None) -> None:
    """Roll out `count` prompt groups as a RaaS (rewards 0, 1, 0, 1); `token`: one trajectory's last token."""
    entries = await bus.read(bus.keys.prompts, GROUP_RAAS, "raas-sim", count, None)
    items = []
    for e in entries:
        group = decode(e.fields, PromptGroup)
        trajs = [trajectory("policy", float(i % 2), 0, tokens=12) for i in range(group.n_samples)]
        if token is not None:
            ids = trajs[1].token_ids.copy()
            ids[-1] = token
            trajs[1] = dataclasses.replace(trajs[1], token_ids=ids)
        rollout = RolloutGroup(
            uid=group.uid, raas="raas-sim", version=0, trajectories=trajs, models=["policy"]
        )
        items.append((e, [Out(bus.keys.rollouts, encode(rollout))]))
    assert len(items) == count
    await bus.handoff(bus.keys.prompts, GROUP_RAAS, "raas-sim", items)


async def until(predicate, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def formed(bus, n: int) -> None:
    await until(lambda: _count(bus.redis.xlen(bus.keys.batches("policy")), n))


async def _count(awaitable, n: int) -> bool:
    return await awaitable >= n


async def corrupt_first_batch(bus) -> None:
    """Replace the rollout bytes of the first batch's groups: its step raises (a DecodeError) every time."""
    [(_, fields)] = await bus.redis.xrange(bus.keys.batches("policy"), count=1)
    for ref in fields[b"refs"].decode().split():
        stored = await bus.redis.hget(bus.keys.samples("policy"), ref)
        group = unpack(SampleGroup, stored)
        bad = dataclasses.replace(group, rollout=b"\xc1 not a rollout")
        await bus.redis.hset(bus.keys.samples("policy"), ref, pack(bad))


@pytest.mark.parametrize("poison", ["token_outside_the_vocabulary", "step_that_raises"])
async def test_a_poison_batch_is_set_aside_within_two_attempts_and_the_next_one_trains(
    bus, redis_url, tiny_model, tmp_path, poison
):
    s = settings_for(redis_url, tiny_model, tmp_path)
    s.trainer.max_steps = 1
    vocab = json.loads((Path(tiny_model) / "config.json").read_text())["vocab_size"]
    bus.settings = bus.settings.model_copy(update={"trim_interval_ms": 10**9})  # keep `versions` to check
    await heartbeat(bus, "sim", 8)
    # A collector that does not know the vocabulary (a hub id): the trainer is the last line.
    setup = dataclasses.replace(dataflow_setup(s), model_paths={})
    dataflow = Dataflow(setup, bus, "df", rows=[{"prompt": "1+1=", "answer": "2"}] * 50)
    stop = asyncio.Event()
    df_task = asyncio.create_task(dataflow.run(stop))
    starts, codes = 0, []
    trainer = None
    try:
        await until(lambda: _count(bus.redis.xlen(bus.keys.prompts), 4))
        await hand_back(bus, 2, token=vocab + 7 if poison == "token_outside_the_vocabulary" else None)
        await formed(bus, 1)
        if poison == "step_that_raises":
            await corrupt_first_batch(bus)
        await hand_back(bus, 2)
        await formed(bus, 2)
        while starts < 4:
            trainer, starts = spawn(s), starts + 1
            codes.append(await asyncio.to_thread(trainer.wait, 120))
            if codes[-1] == 0:
                break
    finally:
        if trainer is not None and trainer.poll() is None:
            os.killpg(trainer.pid, signal.SIGKILL)
            trainer.wait()
        stop.set()
        await df_task
    log = (s.run.path / "trainer.log").read_text()[-3000:]
    assert codes == ([0] if poison == "token_outside_the_vocabulary" else [1, 1, 0]), log

    [(_, dead)] = await bus.redis.xrange(bus.keys.dead)
    reason = dead[b"reason"].decode()
    assert dead[b"field.uid"].decode().endswith(":1"), reason  # the first batch
    if poison == "token_outside_the_vocabulary":
        assert (
            reason.startswith("step refused: sample ")
            and f"token id {vocab + 7} outside the embedding" in reason
        )
    else:
        assert reason.startswith("the trainer died during 2 steps on it; last error: DecodeError: ")
    ledger = await read_ledger(bus, ["policy"])
    assert not ledger.problems(), ledger.render()
    assert (ledger.models["policy"].trained, ledger.models["policy"].dead) == (2, 2)
    versions = [decode(f, VersionPublished).version for _, f in await bus.redis.xrange(bus.keys.versions)]
    assert versions[-1] == 1  # the good batch trained: one version, not two

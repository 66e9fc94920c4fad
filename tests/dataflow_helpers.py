"""Stand-ins for the RaaS pool and the trainers around a dataflow under test: they speak the real
messages over the real streams, with rewards and token versions the test chooses."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from astraflow.dataflow.batches import fetch_batch
from astraflow.messages import (
    Heartbeat,
    PromptGroup,
    RolloutGroup,
    Trajectory,
    VersionPublished,
    decode,
    encode,
)
from astraflow.streams import Bus, Keys, Out
from astraflow.streams.keys import GROUP_RAAS, GROUP_TRAINER
from astraflow.streams.names import name_key

RewardFn = Callable[[PromptGroup, int], float | None]


def trajectory(
    model: str, reward: float, version: int, tokens: int = 8, metrics: dict[str, float] | None = None
) -> Trajectory:
    mask = np.zeros(tokens, np.uint8)
    mask[tokens // 2 :] = 1
    return Trajectory(
        model=model,
        token_ids=np.arange(tokens, dtype=np.int32),
        logprobs=np.full(tokens, -0.5, np.float32),
        loss_mask=mask,
        versions=np.where(mask == 1, version, -1).astype(np.int32),
        reward=reward,
        metrics=metrics or {},
    )


async def roll_out(
    bus: Bus,
    count: int,
    reward: RewardFn,
    version: int | Callable[[PromptGroup], int] = 0,
    tokens: int = 8,
    metrics: Callable[[PromptGroup, int], dict[str, float]] | None = None,
    statuses: dict[str, list[str]] | None = None,
) -> list[str]:
    """Take up to `count` prompt groups as one RaaS and hand back their rollouts (each trajectory with the
    workflow metrics `metrics(group, i)` when given); returns the uids. `statuses`: each uid's hand-off
    statuses are appended there."""
    entries = await bus.read(bus.keys.prompts, GROUP_RAAS, "raas-sim", count, None)
    items, uids = [], []
    for e in entries:
        group = decode(e.fields, PromptGroup)
        v = version(group) if callable(version) else version
        n = group.n_samples
        trajs = [
            trajectory(m, r, v, tokens, metrics(group, i) if metrics else None)
            for m in group.models
            for i in range(n)
            if (r := reward(group, i)) is not None  # (None: a sample the worker lost)
        ]
        rollout = RolloutGroup(
            uid=group.uid,
            raas="raas-sim",
            version=group.version,
            trajectories=trajs,
            models=list(group.models),
            eval_version=group.eval_version,
            eval_dataset=group.eval_dataset,
        )
        items.append((e, [Out(bus.keys.rollouts, encode(rollout), f"rollout:{group.uid}")]))
        uids.append(group.uid)
    if items:
        replies = await bus.handoff(bus.keys.prompts, GROUP_RAAS, "raas-sim", items)
        for uid, (status, _) in zip(uids, replies, strict=True):
            (statuses if statuses is not None else {}).setdefault(uid, []).append(status)
    return uids


async def heartbeat(bus: Bus, worker: str, slots: int, in_flight: int = 0, groups: int = 0) -> None:
    """Announce a live RaaS with `slots` slots, holding its name as a running worker would."""
    now = time.time()
    beat = Heartbeat(
        uid=worker,
        region="local",
        capacity=slots,
        in_flight=in_flight,
        versions={},
        endpoint=None,
        started_at=now - 60,
        updated_at=now,
        groups=groups,
    )
    holder = f"sim 1 {worker}"
    await bus.redis.set(name_key(bus, "raas", worker), holder)
    await bus.redis.hset(bus.keys.raas(worker), mapping={**encode(beat), "holder": holder})


async def publish_version(bus: Bus, model: str, version: int, eval_: bool = False) -> None:
    msg = VersionPublished(
        uid=f"{model}:{version}",
        model=model,
        version=version,
        manifest_key=bus.keys.weights(model, version),
        step=version,
        incarnation="sim",
        eval=eval_,
    )
    await bus.publish(Out(bus.keys.versions, encode(msg), f"version:{model}:{version}"))


async def train(bus: Bus, model: str, count: int = 100) -> list:
    """Consume and acknowledge formed batches of `model` as its trainer; returns the decoded batches."""
    entries = await bus.read(bus.keys.batches(model), GROUP_TRAINER, "trainer-sim", count, None)
    batches = [(e.fields, await fetch_batch(bus, e.fields)) for e in entries]  # before the ack frees them
    if entries:
        await bus.redis.xack(bus.keys.batches(model), GROUP_TRAINER, *[e.id for e in entries])
    return batches


SMALL_RUN = [
    "run.name=t",
    "dataflow.feeder.n_samples=2",
    "dataflow.dataset.size=50",
    "dataflow.batch.size=64",
    "dataflow.trace_every=1",
]
"""A small run on fakeredis: groups of 2 samples from 50 rows, batches large enough to form none, every
group traced."""


def fake_bus(settings) -> Bus:
    """A bus of run `t` on a fresh fakeredis."""
    import fakeredis

    client = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer(version=(7, 0)), protocol=2)
    return Bus(Keys("t"), settings.streams, client, client, reconnect_max_s=1)


async def small_dataflow(*overrides: str):
    """(bus, dataflow) of a bootstrapped SMALL_RUN with `overrides`."""
    from astraflow.dataflow.service import Dataflow
    from astraflow.launch.build import dataflow_setup
    from astraflow.settings_load import load_settings

    settings = load_settings(None, [*SMALL_RUN, *overrides])
    bus = fake_bus(settings)
    await bus.bootstrap(["policy"])
    return bus, Dataflow(dataflow_setup(settings), bus, "df")

"""A real RaaS (hf engine, tiny model) and eval prompt groups: one waits for its eval version before it
generates, samples greedily as the group asks and hands the eval flags back; an engine ahead of an eval
version goes back to exactly it; a group whose eval version was passed is dropped without generating."""

import asyncio

import pytest

from astraflow.messages import Heartbeat, PromptGroup, VersionNotice, decode, encode
from astraflow.streams import Out
from astraflow.streams.keys import GROUP_RAAS
from tests.integration.raas_helpers import (
    checkpoint_manifest,
    raas_settings,
    rollouts,
    spawn_raas,
    stop,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.one_redis]


def eval_group(version: int, row: int = 0) -> PromptGroup:
    return PromptGroup(
        uid=f"eval:{version}:sums:{row}",
        workflow="rlvr",
        models=["policy"],
        n_samples=4,
        version=version,
        sample={"prompt": "12+34=", "answer": "46"},
        eval_version=version,
        eval_dataset="sums",
        sampling={"temperature": 0.0, "max_new_tokens": 3},
    )


async def submit(bus, group: PromptGroup) -> None:
    await bus.publish(Out(bus.keys.prompts, encode(group), f"prompt:{group.uid}"))


async def announce(bus, directory: str, version: int, eval_: bool, load: int | None = None) -> None:
    """The notice of `version` that loads `load` (default: `version`) from a checkpoint directory."""
    load = version if load is None else load
    manifest = await checkpoint_manifest(bus, directory, "policy", load)
    notice = VersionNotice(
        uid=f"v{version}",
        version=version,
        models={"policy": load},
        manifests={"policy": manifest},
        checkpoints={"policy": directory},
        eval=eval_,
    )
    await bus.publish(Out(bus.keys.notices, encode(notice), f"notice:{version}"))


async def test_an_eval_group_runs_greedily_on_exactly_its_version(
    bus, redis_url, tiny_model, tiny_model_v2, tmp_path
):
    worker = spawn_raas(raas_settings(redis_url, tiny_model, tmp_path, "raas-a", slots=4))
    try:
        await submit(bus, eval_group(1))
        heartbeat = bus.keys.raas("raas-a")
        await wait_for(lambda: bus.redis.exists(heartbeat), 60, "the worker up")
        assert await bus.redis.xlen(bus.keys.rollouts) == 0  # its engine is at version 0: it waits

        await announce(bus, tiny_model_v2, 1, eval_=True)
        await wait_for(rolled_out(bus, 1), 60, "the eval group rolled out")
        [rollout] = await rollouts(bus)
        assert (rollout.eval_version, rollout.eval_dataset) == (1, "sums")
        completions = set()
        for t in rollout.trajectories:
            sampled = t.loss_mask == 1
            assert set(t.versions[sampled].tolist()) == {1}  # every token of the eval version
            assert 0 < sampled.sum() <= 3  # the group's token limit, not the RaaS's (4)
            completions.add(tuple(t.token_ids[sampled].tolist()))
        assert len(completions) == 1  # greedy: four samples, one completion
    finally:
        assert stop(worker) == 0


def rolled_out(bus, n: int):
    async def check() -> bool:
        return await bus.redis.xlen(bus.keys.rollouts) == n

    return check


async def test_an_engine_ahead_of_an_eval_version_goes_back_to_it(
    bus, redis_url, tiny_model, tiny_model_v2, tmp_path
):
    """A RaaS may hold weights newer than an eval version announced next (it retried a failed load with
    the newest ones; here a notice of version 0 loads version 2):
    the eval notice loads exactly that version, and the eval group waits for it rather than running on
    the newer weights (whose rows the collector would drop). Once a later notice is applied, a group of
    the passed eval version is dropped at once, without generating."""
    worker = spawn_raas(raas_settings(redis_url, tiny_model, tmp_path, "raas-a", slots=4))
    heartbeat = bus.keys.raas("raas-a")

    def at_version(v: int):
        async def check() -> bool:
            fields = await bus.redis.hgetall(heartbeat)
            return bool(fields) and decode(fields, Heartbeat).versions == {"policy": v}

        return check

    try:
        await announce(bus, tiny_model_v2, 0, eval_=False, load=2)
        await wait_for(at_version(2), 60, "the worker at version 2")
        await submit(bus, eval_group(1))

        async def taken() -> bool:
            return (await bus.redis.xpending(bus.keys.prompts, GROUP_RAAS))["pending"] == 1

        await wait_for(taken, 30, "the worker took the eval group")
        await asyncio.sleep(2)
        assert await bus.redis.xlen(bus.keys.rollouts) == 0  # not on version 2

        await announce(bus, tiny_model, 1, eval_=True)
        await wait_for(rolled_out(bus, 1), 60, "the eval group rolled out")
        [rollout] = await rollouts(bus)
        for t in rollout.trajectories:
            assert set(t.versions[t.loss_mask == 1].tolist()) == {1}
        assert len(rollout.trajectories) == 4

        await announce(bus, tiny_model_v2, 3, eval_=False)
        await wait_for(at_version(3), 60, "the worker at version 3")
        await submit(bus, eval_group(1, row=1))
        await wait_for(rolled_out(bus, 2), 30, "the passed eval group handed back")
        passed = (await rollouts(bus))[1]
        assert passed.trajectories == [] and "eval version 1 not loaded: notice 3" in passed.error
    finally:
        assert stop(worker) == 0

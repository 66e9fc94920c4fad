"""A prompt group (a dataset row, anything that can write to `prompts`) picks among registered names and the
`module:Name` code the recipe names, never other code: anything else is dead-lettered, unimported."""

import asyncio
import os

import pytest

from astraflow.config import Settings
from astraflow.dataflow.service import Dataflow
from astraflow.launch.build import dataflow_setup, raas_setup
from astraflow.messages import PromptGroup, RolloutGroup, decode, encode
from astraflow.raas.worker import RaasWorker
from astraflow.streams import Out
from astraflow.streams.reap import Reaper
from astraflow.workflows.api import UnknownName, resolve_workflow, reward_name
from astraflow.workflows.rewards import RewardRunner

ECHO = "tests.integration.user_code:Echo"
SLOW = "tests.integration.user_code:slow"


class Idle:
    """An engine no test workflow calls."""

    version = 0


@pytest.fixture
def called(monkeypatch):
    calls = []
    monkeypatch.setattr(os, "system", lambda *a: calls.append(a) or 0)
    return calls


async def run_groups(bus, groups, **raas) -> tuple[list[RolloutGroup], list[dict]]:
    """Run a RaaS worker (recipe: `raas`) over `groups` until each is rolled out or dead-lettered."""
    settings = Settings()
    for k, v in raas.items():
        setattr(settings.raas, k, v)
    worker = RaasWorker(raas_setup(settings), bus, {"policy": Idle()}, "raas-t", {})
    reaper = Reaper(bus)  # the dataflow's part: it dead-letters the prompts a RaaS gave up on

    async def settled() -> int:
        return await bus.redis.xlen(bus.keys.rollouts) + await bus.redis.xlen(bus.keys.dead)

    before = await settled()  # (what earlier calls left)
    await bus.publish_many([Out(bus.keys.prompts, encode(g), f"prompt:{g.uid}") for g in groups])
    stop = asyncio.Event()
    task = asyncio.create_task(worker.runner.run(stop))
    try:
        async with asyncio.timeout(30):
            while await settled() - before < len(groups):
                await reaper.sweep(bus.keys.prompts)
                await asyncio.sleep(0.02)
    finally:
        stop.set()
        await task
        worker.ctx.rewards.close()
    done = [decode(f, RolloutGroup) for _, f in await bus.redis.xrange(bus.keys.rollouts)]
    dead = [
        {k.decode(): v.decode(errors="replace") for k, v in f.items()}
        for _, f in await bus.redis.xrange(bus.keys.dead)
    ]
    return done, dead


def group(uid: str, workflow: str = ECHO, **sample) -> PromptGroup:
    return PromptGroup(uid, workflow, ["policy"], 2, 0, {"prompt": "1+1=", "answer": "2", **sample})


async def test_prompt_group_naming_os_system_as_reward_or_workflow_is_dead_lettered_uncalled(bus, called):
    groups = [group("g-reward", reward="os:system"), group("g-flow", workflow="os:system"), group("g-ok")]
    done, dead = await run_groups(bus, groups, allowed_code=[ECHO])
    assert [g.uid for g in done] == ["g-ok"]
    reasons = {d["field.uid"]: d["reason"] for d in dead}
    assert "reward 'os:system' is not registered or named in the recipe" in reasons["g-reward"]
    assert "workflow 'os:system' is not registered or named in the recipe" in reasons["g-flow"]
    assert called == []


async def test_workflow_a_row_names_runs_only_when_the_recipe_names_it(bus):
    done, dead = await run_groups(bus, [group("g-echo")])
    assert done == [] and f"workflow {ECHO!r} is not registered or named" in dead[0]["reason"]
    await bus.redis.delete(bus.keys.dead)
    done, dead = await run_groups(bus, [group("g-echo-2")], allowed_code=[ECHO])
    assert dead == [] and [t.reward for t in done[0].trajectories] == [0.5, 0.5]


async def test_recipe_named_reward_runs_and_others_are_refused():
    runner = RewardRunner(processes=1, timeout_s=20, allowed=[SLOW])
    try:
        assert await runner.score(SLOW, "p", "c", {"sleep_s": 0}) == (1.0, None)
        score, error = await runner.score("os:system", "p", "c", {})
        assert score == 0.0 and "reward 'os:system' is not registered or named in the recipe" in error
    finally:
        runner.close()


def test_recipe_names_its_feeder_workflow_and_reward_option():
    s = Settings()
    s.dataflow.feeder.workflow = ECHO
    s.raas.workflow_options = {"reward": SLOW}
    assert s.named_code == {ECHO, SLOW}
    assert resolve_workflow(ECHO, s.named_code).__name__ == "Echo"
    with pytest.raises(UnknownName, match="not registered or named in the recipe"):
        resolve_workflow("os:system", s.named_code)


async def test_numeric_reward_column_is_data_not_a_reward_name(bus):
    assert reward_name({"reward": 0.5}, {}) == "exact_match"
    assert reward_name({"reward": 0.5}, {"reward": "math_verify"}) == "math_verify"
    assert reward_name({"reward": "math_verify"}, {"reward": "exact_match"}) == "math_verify"
    done, dead = await run_groups(bus, [group("g-num", reward=0.5)], allowed_code=[ECHO])
    assert dead == [] and [g.uid for g in done] == ["g-num"]


async def test_dataset_row_naming_unnamed_code_is_a_load_error_not_a_dead_letter_per_group(bus):
    rows = [{"prompt": "1+1=", "answer": "2", "reward": 0.5}, {"prompt": "2+2=", "reward": "os:system"}]
    with pytest.raises(
        ValueError, match=r"row 1: reward 'os:system' is not registered or named in the recipe"
    ):
        Dataflow(dataflow_setup(Settings()), bus, "df", rows)
    settings = Settings()
    settings.raas.allowed_code = [SLOW]
    Dataflow(
        dataflow_setup(settings),
        bus,
        "df",
        [{"prompt": "1+1=", "reward": SLOW}, {"prompt": "2+2=", "reward": 0.5}],
    )

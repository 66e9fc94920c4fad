"""A real RaaS (hf engine, tiny model) and an eval prompt group: it waits for the group's eval version
before it generates, samples it greedily as the group asks, and hands the eval flags back."""

import pytest

from astraflow.messages import PromptGroup, VersionNotice, encode
from astraflow.streams import Out
from tests.integration.raas_helpers import (
    checkpoint_manifest,
    raas_settings,
    rollouts,
    spawn_raas,
    stop,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def test_an_eval_group_runs_greedily_on_exactly_its_version(
    bus, redis_url, tiny_model, tiny_model_v2, tmp_path
):
    worker = spawn_raas(raas_settings(redis_url, tiny_model, tmp_path, "raas-a", slots=4))
    try:
        group = PromptGroup(
            uid="eval:1:sums:0",
            workflow="rlvr",
            models=["policy"],
            n_samples=4,
            version=1,
            sample={"prompt": "12+34=", "answer": "46"},
            eval_version=1,
            eval_dataset="sums",
            sampling={"temperature": 0.0, "max_new_tokens": 3},
        )
        await bus.publish(Out(bus.keys.prompts, encode(group), f"prompt:{group.uid}"))
        heartbeat = bus.keys.raas("raas-a")
        await wait_for(lambda: bus.redis.exists(heartbeat), 60, "the worker up")
        assert await bus.redis.xlen(bus.keys.rollouts) == 0  # its engine is at version 0: it waits

        manifest = await checkpoint_manifest(bus, tiny_model_v2, "policy", 1)
        notice = VersionNotice(
            uid="v1",
            version=1,
            models={"policy": 1},
            manifests={"policy": manifest},
            checkpoints={"policy": tiny_model_v2},
            eval=True,
        )
        await bus.publish(Out(bus.keys.notices, encode(notice), "notice:1"))

        async def rolled_out():
            return await bus.redis.xlen(bus.keys.rollouts) == 1

        await wait_for(rolled_out, 60, "the eval group rolled out")
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

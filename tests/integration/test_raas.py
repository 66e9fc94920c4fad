"""RaaS workers as real processes (hf engine, tiny model) against a real Redis, under faults."""

import asyncio
from collections import Counter

import httpx
import pytest

from astraflow.messages import Heartbeat, VersionNotice, decode, encode
from astraflow.redis_server import free_port
from astraflow.streams import Out
from astraflow.streams.keys import GROUP_RAAS
from tests.integration.raas_helpers import (
    checkpoint_manifest,
    kill_session,
    raas_settings,
    rollouts,
    spawn_raas,
    stop,
    submit,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.one_redis]


async def count(bus):
    return await bus.redis.xlen(bus.keys.rollouts)


async def test_prompts_become_rollout_groups_and_weights_follow_notices(
    bus, redis_url, tiny_model, tiny_model_v2, tmp_path
):
    metrics_port = free_port()
    worker = spawn_raas(
        raas_settings(redis_url, tiny_model, tmp_path, "raas-a", slots=4, metrics_port=metrics_port)
    )
    try:
        uids = await submit(bus, 6, n_samples=3)
        await wait_for(lambda: _at_least(bus, 6), what="6 rollout groups")
        groups = {g.uid: g for g in await rollouts(bus)}
        assert sorted(groups) == uids
        for g in groups.values():
            assert g.raas == "raas-a" and len(g.trajectories) == 3 and g.error is None
            for t in g.trajectories:
                prompt = t.loss_mask == 0
                assert prompt[0] and not prompt[-1]  # prompt first, then the completion
                assert set(t.versions[prompt]) == {-1} and set(t.versions[~prompt]) == {0}
                assert (t.logprobs[~prompt] <= 0).all() and t.reward in (0.0, 1.0) and t.error is None
        beat = decode(await bus.redis.hgetall(bus.keys.raas("raas-a")), Heartbeat)
        assert beat.capacity == 4 and beat.versions == {"policy": 0} and beat.engine == f"hf:{tiny_model}"
        metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text
        labels = '{policy="policy",run="it",worker="raas-a"}'  # sorted, as prometheus-client writes them
        assert f"astraflow_raas_episodes_total{labels} 18.0" in metrics
        assert f"astraflow_raas_slots{labels} 4.0" in metrics

        manifest = await checkpoint_manifest(bus, tiny_model_v2, "policy", 1)
        notice = VersionNotice(
            uid="v1",
            version=1,
            models={"policy": 1},
            manifests={"policy": manifest},
            checkpoints={"policy": tiny_model_v2},
        )
        await bus.publish(Out(bus.keys.notices, encode(notice), "notice:1"))

        async def loaded():
            return decode(await bus.redis.hgetall(bus.keys.raas("raas-a")), Heartbeat).versions == {
                "policy": 1
            }

        await wait_for(loaded, 30, "version 1 loaded")
        await submit(bus, 2, start=100)
        await wait_for(lambda: _at_least(bus, 8), what="2 more groups")
        late = [g for g in await rollouts(bus) if g.uid >= "g0100"]
        assert {int(v) for g in late for t in g.trajectories for v in t.versions if v >= 0} == {1}
    finally:
        assert stop(worker) == 0
    assert not await bus.redis.exists(bus.keys.raas("raas-a"))  # deregistered


async def _at_least(bus, n):
    return await count(bus) >= n


async def test_killed_raas_mid_episode_is_finished_by_another_exactly_once(
    bus, redis_url, tiny_model, tmp_path
):
    slow = "tests.integration.user_code:slow"
    first = spawn_raas(
        raas_settings(redis_url, tiny_model, tmp_path, "raas-1", reward_timeout_s=60, allowed_code=[slow])
    )
    [uid] = await submit(bus, 1, n_samples=2, reward=slow, sleep_s=3.0)

    async def held():
        return len(await bus.redis.xpending_range(bus.keys.prompts, GROUP_RAAS, "-", "+", 10, "raas-1")) == 1

    await wait_for(held, what="raas-1 holding the group")
    await asyncio.sleep(1.0)  # mid-episode: its reward is running
    kill_session(first)  # kill -9 of the worker and everything it started
    second = spawn_raas(
        raas_settings(redis_url, tiny_model, tmp_path, "raas-2", reward_timeout_s=60, allowed_code=[slow])
    )
    try:
        await wait_for(lambda: _at_least(bus, 1), 60, "the group finished by raas-2")
        await asyncio.sleep(1.0)  # anything late would show up now
        [group] = await rollouts(bus)
        assert group.uid == uid and group.raas == "raas-2"
    finally:
        stop(second)


async def test_workers_join_and_leave_mid_run_without_losing_work(bus, redis_url, tiny_model, tmp_path):
    slow = "tests.integration.user_code:slow"
    a = spawn_raas(
        raas_settings(
            redis_url, tiny_model, tmp_path, "raas-a", slots=2, reward_timeout_s=60, allowed_code=[slow]
        )
    )
    uids = await submit(bus, 4, n_samples=1, reward=slow, sleep_s=0.2)
    await wait_for(lambda: _at_least(bus, 4), 60, "raas-a working alone")
    b = spawn_raas(
        raas_settings(
            redis_url, tiny_model, tmp_path, "raas-b", slots=2, reward_timeout_s=60, allowed_code=[slow]
        )
    )
    try:
        await wait_for(lambda: bus.redis.exists(bus.keys.raas("raas-b")), 60, "raas-b registered")
        uids += await submit(bus, 12, start=4, n_samples=1, reward=slow, sleep_s=1.0)
        await wait_for(lambda: _done_by(bus, "raas-b"), 60, "raas-b taking work")
        assert stop(a) == 0  # SIGTERM mid-run: it finishes or releases what it holds
        await wait_for(lambda: _at_least(bus, 16), 90, "all groups")
        by_uid = Counter(g.uid for g in await rollouts(bus))
        assert sorted(by_uid) == uids and max(by_uid.values()) == 1
        assert {g.raas for g in await rollouts(bus)} == {"raas-a", "raas-b"}
        assert await bus.redis.xlen(bus.keys.dead) == 0
    finally:
        stop(a)
        stop(b)


async def _done_by(bus, worker):
    return any(g.raas == worker for g in await rollouts(bus))


async def test_rewards_that_raise_or_hang_fail_their_trajectories_not_the_worker(
    bus, redis_url, tiny_model, tmp_path
):
    code = ["tests.integration.user_code:boom", "tests.integration.user_code:hang"]
    # The timeout leaves a loaded machine time to start the reward processes and raise; a hang still ends.
    worker = spawn_raas(
        raas_settings(redis_url, tiny_model, tmp_path, "raas-r", reward_timeout_s=5.0, allowed_code=code)
    )
    try:
        await submit(bus, 1, start=0, reward=code[0])
        await submit(bus, 1, start=1, reward=code[1])
        await submit(bus, 1, start=2)  # a normal group after them
        await wait_for(lambda: _at_least(bus, 3), 60, "three groups")
        errors = {g.uid: {t.error for t in g.trajectories} for g in await rollouts(bus)}
        [boom] = errors["g0000"]
        assert "raised ValueError: reward exploded" in boom
        [hang] = errors["g0001"]
        assert "timed out after 5.0s" in hang
        assert errors["g0002"] == {None}
        assert worker.poll() is None
        assert (await bus.redis.xpending(bus.keys.prompts, GROUP_RAAS))["pending"] == 0  # not retried
        assert await bus.redis.xlen(bus.keys.dead) == 0
    finally:
        stop(worker)


async def test_a_users_workflow_runs_by_module_and_class_name(bus, redis_url, tiny_model, tmp_path):
    echo = "tests.integration.user_code:Echo"
    worker = spawn_raas(raas_settings(redis_url, tiny_model, tmp_path, "raas-u", allowed_code=[echo]))
    try:
        await submit(bus, 2, workflow=echo)
        await wait_for(lambda: _at_least(bus, 2), what="two groups")
        for g in await rollouts(bus):
            assert [t.reward for t in g.trajectories] == [0.5, 0.5]
    finally:
        stop(worker)

"""The bus under faults on a real redis-server: kill -9, slow entries, poison entries, lost replies."""

import asyncio
import time

import pytest

from astraflow.launch.demo import rollout
from astraflow.messages import SCHEMA_VERSION, PromptGroup, decode, encode
from astraflow.streams import DUP, OK, Consumer, Out, Runner
from astraflow.streams.keys import GROUP_RAAS
from astraflow.streams.reap import Reaper
from astraflow.streams.trim import trim
from tests.integration.workers import feed, rollout_uids, settings_for, spawn_worker, wait_pending

pytestmark = pytest.mark.integration


async def passthrough(bus, name):
    """An in-test consumer doing the same hand-off as the demo worker."""

    async def handle(entry):
        group = decode(entry.fields, PromptGroup)
        return [Out(bus.keys.rollouts, encode(rollout(group, name)), f"rollout:{group.uid}")]

    return handle


async def run_until(runner, cond, timeout_s=20):
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop, drain_s=5))
    deadline = time.monotonic() + timeout_s
    while not await cond() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    stop.set()
    await task


async def test_killed_consumer_entry_is_reclaimed_and_processed_once(bus, redis_url):
    settings = settings_for(redis_url, episode_ms=60_000)
    [uid] = await feed(bus, 1)
    victim = spawn_worker(settings, "victim")
    try:
        [held] = await wait_pending(bus, "victim", 1)
    finally:
        victim.kill()
        victim.wait()
    entry_id = held["message_id"].decode()

    rescuer = Runner(Consumer(bus, bus.keys.prompts, GROUP_RAAS, "rescuer"), await passthrough(bus, "r"), 4)
    started = time.monotonic()

    async def rolled_out():
        return await bus.redis.xlen(bus.keys.rollouts) == 1

    await run_until(rescuer, rolled_out)
    assert await rollout_uids(bus) == [uid]
    assert time.monotonic() - started >= bus.settings.lease_ms / 1000 * 0.9  # not before the lease ran out
    # The dead consumer's hand-off arriving late (a reply stuck in its socket) must not yield a second output.
    late = Out(bus.keys.rollouts, {"kind": "late"}, "late-output")
    [(status, _)] = await bus.handoff(bus.keys.prompts, GROUP_RAAS, "victim", [(entry_id, [late])])
    assert status == DUP  # already acknowledged by the rescuer: nothing written
    assert await rollout_uids(bus) == [uid]
    assert (await bus.redis.xpending(bus.keys.prompts, GROUP_RAAS))["pending"] == 0


async def test_slow_entry_whose_owner_renews_is_never_reclaimed(bus, redis_url):
    episode_s = 8 * bus.settings.lease_ms / 1000
    settings = settings_for(redis_url, episode_ms=int(episode_s * 1000))
    # the thief reclaims after the lease the owner renews within (every consumer of a run shares one)
    bus.settings = bus.settings.model_copy(update={"lease_ms": settings.streams.lease_ms})
    [uid] = await feed(bus, 1)
    owner = spawn_worker(settings, "owner")
    try:
        await wait_pending(bus, "owner", 1)
        thief = Consumer(bus, bus.keys.prompts, GROUP_RAAS, "thief")
        while await bus.redis.xlen(bus.keys.rollouts) == 0:
            thief._next_reclaim = 0  # try to reclaim on every read
            assert await thief.read(4, block_ms=50) == []
            assert owner.poll() is None
    finally:
        owner.terminate()
        owner.wait(timeout=30)
    rollouts = await bus.redis.xrange(bus.keys.rollouts)
    assert len(rollouts) == 1 and await rollout_uids(bus) == [uid]
    assert rollouts[0][1][b"data"]  # written by the owner
    assert b"owner" in rollouts[0][1][b"data"]


async def test_poison_entries_go_to_dead_and_the_consumer_keeps_going(bus):
    uids = await feed(bus, 6)
    junk = {"kind": "prompt_group", "schema": str(SCHEMA_VERSION), "data": b"\xc1garbage"}
    await bus.publish(Out(bus.keys.prompts, junk, "junk"))
    later = await feed(bus, 8, start=6)  # published after the poison; must still be processed
    inner = await passthrough(bus, "c")
    attempts = 0

    async def handle(entry):
        nonlocal attempts
        if entry.fields.get("uid") == b"g000003":
            attempts += 1
            raise ValueError("this group always fails")
        return await inner(entry)

    runner = Runner(Consumer(bus, bus.keys.prompts, GROUP_RAAS, "c"), handle, 4)
    reaper = Reaper(bus)  # the dataflow's part: no RaaS dead-letters a prompt

    async def settled():
        await reaper.sweep(bus.keys.prompts)
        return await bus.redis.xlen(bus.keys.dead) == 2 and await bus.redis.xlen(bus.keys.rollouts) == 13

    await run_until(runner, settled, timeout_s=30)
    assert attempts == bus.settings.max_deliveries
    dead = {f[b"source_id"]: f for _, f in await bus.redis.xrange(bus.keys.dead)}
    reasons = sorted(f[b"reason"].decode() for f in dead.values())
    assert "last error: c: DecodeError: data: not valid msgpack" in reasons[0]
    assert "last error: c: ValueError: this group always fails" in reasons[1]
    assert all(f"delivered {bus.settings.max_deliveries} times" in r for r in reasons)
    assert sorted(await rollout_uids(bus)) == sorted(u for u in uids + later if u != "g000003")
    assert (await bus.redis.xpending(bus.keys.prompts, GROUP_RAAS))["pending"] == 0


async def test_handoff_with_a_lost_reply_is_applied_exactly_once(bus):
    await feed(bus, 1)
    c = Consumer(bus, bus.keys.prompts, GROUP_RAAS, "c")
    [entry] = await c.read(1, block_ms=10)
    out = Out(bus.keys.rollouts, {"data": b"r"}, "r")
    # The first call executes but its reply is lost; the caller retries the same hand-off.
    [(first, _)] = await bus.handoff(bus.keys.prompts, GROUP_RAAS, "c", [(entry.id, [out])])
    [(retry, _)] = await bus.handoff(bus.keys.prompts, GROUP_RAAS, "c", [(entry.id, [out])])
    assert (first, retry) == (OK, DUP)
    assert await bus.redis.xlen(bus.keys.rollouts) == 1


async def test_entry_with_thousands_of_fields_is_dead_lettered_not_crash_looped(bus):
    huge = [f"f{i}" for i in range(3000)]
    await bus.redis.xadd(bus.keys.prompts, dict.fromkeys(huge, b"v"))  # written by some other tool
    uids = await feed(bus, 3)

    async def handle(entry):
        if len(entry.fields) > 100:
            raise ValueError("not a prompt group")
        return await (await passthrough(bus, "c"))(entry)

    runner = Runner(Consumer(bus, bus.keys.prompts, GROUP_RAAS, "c"), handle, 4)
    reaper = Reaper(bus)  # the dataflow's part: no RaaS dead-letters a prompt

    async def settled():
        await reaper.sweep(bus.keys.prompts)
        return await bus.redis.xlen(bus.keys.dead) == 1 and await bus.redis.xlen(bus.keys.rollouts) == 3

    await run_until(runner, settled, timeout_s=30)
    [(_, dead)] = await bus.redis.xrange(bus.keys.dead)
    assert dead[b"fields_truncated"] == b"3000"
    assert b"ValueError: not a prompt group" in dead[b"reason"]
    assert sorted(await rollout_uids(bus)) == uids


async def test_trim_keeps_everything_a_group_has_not_acknowledged(bus):
    uids = await feed(bus, 6)
    c = Consumer(bus, bus.keys.prompts, GROUP_RAAS, "c")
    got = await c.read(4, block_ms=10)
    await c.complete([(got[0], []), (got[2], [])])
    assert await trim(bus, bus.keys.prompts) == 1
    await c.complete([(got[1], []), (got[3], [])])
    assert await trim(bus, bus.keys.prompts) == 3
    left = [decode(f, PromptGroup).uid for _, f in await bus.redis.xrange(bus.keys.prompts)]
    assert left == uids[4:]  # delivered to nobody yet


async def test_worker_with_a_hung_handler_exits_non_zero_and_releases_the_entry(bus, redis_url):
    settings = settings_for(redis_url, episode_ms=60_000)  # an episode that never ends in time
    settings.streams.handler_timeout_s = 0.5
    [uid] = await feed(bus, 1)
    worker = spawn_worker(settings, "stuck")
    try:
        code = await asyncio.wait_for(asyncio.to_thread(worker.wait), 60)
    finally:
        worker.kill()
        worker.wait()
    assert code != 0  # its supervisor restarts it
    assert list((await bus.redis.hgetall(bus.keys.errors)).values()) == [
        b"stuck: handler timed out after 0.5 s"
    ]
    rescuer = Consumer(bus, bus.keys.prompts, GROUP_RAAS, "rescuer")
    [entry] = await rescuer.read(1, block_ms=10)  # released: taken at once, no lease to wait out
    assert decode(entry.fields, PromptGroup).uid == uid

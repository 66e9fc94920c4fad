"""The consume loop: capacity, dead letters, cancellation leaves no handler behind."""

import asyncio
import math

import pytest
from redis.exceptions import ConnectionError, ResponseError
from structlog.testing import capture_logs

from astraflow.errors import DecodeError, WorkerUnhealthy
from astraflow.streams import Consumer, Out, Runner
from astraflow.streams import runner as runner_module
from astraflow.streams.keys import GROUP_DATAFLOW, GROUP_RAAS
from astraflow.streams.reap import Reaper


async def fill(bus, n):
    await bus.publish_many([Out(bus.keys.prompts, {"uid": f"u{i}"}, f"p{i}") for i in range(n)])


async def test_runner_holds_at_most_its_capacity(bus):
    await fill(bus, 10)
    running, peak = 0, 0
    release = asyncio.Event()

    async def handle(entry):
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await release.wait()
        running -= 1
        return [Out(bus.keys.rollouts, {"uid": entry.fields["uid"]})]

    runner = Runner(Consumer(bus, bus.keys.prompts, GROUP_RAAS, "c"), handle, 3)
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    await asyncio.sleep(0.3)
    assert peak == 3 and len(runner.consumer.in_flight) == 3
    release.set()
    while await bus.redis.xlen(bus.keys.rollouts) < 10:
        await asyncio.sleep(0.02)
    stop.set()
    await task
    assert peak == 3 and runner.stats["ok"] == 10


def failing_u2(out_stream):
    """A handler that hands each entry on to `out_stream`, but cannot decode the one of uid u2."""

    async def handle(entry):
        if entry.fields["uid"] == b"u2":
            raise DecodeError("data: not valid msgpack")
        return [Out(out_stream, {"uid": entry.fields["uid"]})]

    return handle


async def run_until(runner, done) -> None:
    """Run `runner` until `await done()`, then stop it."""
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    while not await done():
        await asyncio.sleep(0.02)
    stop.set()
    await task


async def test_undecodable_entry_is_dead_lettered_and_the_rest_flows(bus):
    """Where the consumer may dead-letter (here the dataflow's `rollouts`), at once."""
    await bus.publish_many([Out(bus.keys.rollouts, {"uid": f"u{i}"}, f"r{i}") for i in range(5)])
    runner = Runner(Consumer(bus, bus.keys.rollouts, GROUP_DATAFLOW, "c"), failing_u2(bus.keys.metrics), 2)
    await run_until(runner, lambda: _at_least(bus, bus.keys.metrics, 4))
    [(_, dead)] = await bus.redis.xrange(bus.keys.dead)
    assert dead[b"reason"] == b"DecodeError: data: not valid msgpack" and dead[b"field.uid"] == b"u2"
    assert runner.stats["dead"] == 1


async def test_a_raas_releases_an_undecodable_prompt_until_the_dataflow_dead_letters_it(bus):
    """A RaaS may not write `dead`: an undecodable prompt is released with its reason, delivered
    max_deliveries times (no more), then dead-lettered by the dataflow's reaper with that reason."""
    await fill(bus, 5)
    runner = Runner(Consumer(bus, bus.keys.prompts, GROUP_RAAS, "c"), failing_u2(bus.keys.rollouts), 2)

    async def released_thrice() -> bool:
        if runner.stats["released"] < 3 or not await _at_least(bus, bus.keys.rollouts, 4):
            return False
        await asyncio.sleep(0.3)  # (a further delivery would show meanwhile)
        return True

    await run_until(runner, released_thrice)
    assert runner.stats["released"] == bus.settings.max_deliveries == 3 and runner.stats["dead"] == 0
    assert await bus.redis.xlen(bus.keys.dead) == 0
    assert await Reaper(bus).sweep(bus.keys.prompts) == 1
    [(_, dead)] = await bus.redis.xrange(bus.keys.dead)
    assert dead[b"reason"].endswith(b"last error: c: DecodeError: data: not valid msgpack")
    assert dead[b"field.uid"] == b"u2" and dead[b"deliveries"] == b"3"
    assert (await bus.redis.xpending(bus.keys.prompts, GROUP_RAAS))["pending"] == 0


async def _at_least(bus, stream: str, n: int) -> bool:
    return await bus.redis.xlen(stream) >= n


async def test_cancelled_runner_leaves_no_handler_running(bus):
    await fill(bus, 4)
    cancelled = []

    async def handle(entry):
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(entry.id)
            raise
        return []

    runner = Runner(Consumer(bus, bus.keys.prompts, GROUP_RAAS, "c"), handle, 4)
    task = asyncio.create_task(runner.run(asyncio.Event()))
    await asyncio.sleep(0.3)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert len(cancelled) == 4
    assert not [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]


async def test_stop_drains_then_releases_what_did_not_finish(bus):
    await fill(bus, 2)

    async def handle(entry):
        await asyncio.sleep(0 if entry.fields["uid"] == b"u0" else 60)
        return [Out(bus.keys.rollouts, {"uid": entry.fields["uid"]})]

    runner = Runner(Consumer(bus, bus.keys.prompts, GROUP_RAAS, "c"), handle, 2)
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop, drain_s=0.2))
    await asyncio.sleep(0.2)
    stop.set()
    await task
    assert await bus.redis.xlen(bus.keys.rollouts) == 1
    assert runner.stats["released"] == 1
    # The released entry is immediately available to another worker.
    other = Consumer(bus, bus.keys.prompts, GROUP_RAAS, "other")
    [entry] = await other.read(1, block_ms=10)
    assert entry.fields["uid"] == b"u1"


async def test_hung_handler_is_cancelled_its_entry_released_and_the_worker_ends_unhealthy(bus):
    bus.settings = bus.settings.model_copy(update={"handler_timeout_s": 0.2})
    await fill(bus, 3)
    cancelled = []

    async def handle(entry):
        if entry.fields["uid"] == b"u1":  # stuck forever (a wedged engine call, a deadlock)
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.append(entry.id)
                raise
        return [Out(bus.keys.rollouts, {"uid": entry.fields["uid"]})]

    runner = Runner(Consumer(bus, bus.keys.prompts, GROUP_RAAS, "c"), handle, 3)
    with pytest.raises(WorkerUnhealthy, match=r"handler timed out after 0\.2 s"):
        await asyncio.wait_for(runner.run(asyncio.Event(), drain_s=1), 10)
    assert runner.unhealthy == "handler timed out after 0.2 s"
    assert len(cancelled) == 1
    assert await bus.redis.xlen(bus.keys.rollouts) == 2  # the others were handed off
    errors = await bus.redis.hgetall(bus.keys.errors)
    assert list(errors.values()) == [b"c: handler timed out after 0.2 s"]
    other = Consumer(bus, bus.keys.prompts, GROUP_RAAS, "other")
    [again] = await other.read(1, block_ms=10)  # released: anyone may take it at once
    assert again.fields["uid"] == b"u1" and again.deliveries == 2


async def test_worker_told_to_stop_during_a_redis_outage_stops(bus):
    await fill(bus, 1)
    bus.reconnect_max_s = math.inf  # a long-running worker waits outages out

    async def unreachable(*args, **kwargs):
        raise ConnectionError("Connection refused")

    async def handle(entry):
        bus.blocking.xreadgroup = unreachable  # Redis goes away after the first entry
        bus._scripts["handoff"] = unreachable
        bus.redis.ping = unreachable  # away, not refusing these requests while it answers others
        return [Out(bus.keys.rollouts, {"uid": entry.fields["uid"]})]

    runner = Runner(Consumer(bus, bus.keys.prompts, GROUP_RAAS, "c"), handle, 2)
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop, drain_s=0.2))
    while not runner.stats and not runner.held:
        await asyncio.sleep(0.01)
    stop.set()
    await asyncio.wait_for(task, 10)  # returns although every call would wait forever
    assert (await bus.redis.xpending(bus.keys.prompts, GROUP_RAAS))["pending"] == 1  # left for a reclaim


async def test_a_failed_loop_logs_the_redis_error_message_not_only_its_type(bus, monkeypatch):
    """redis-py's repr of its errors leaves the message out (`server:ResponseError`): the log says it."""

    async def refused(*args, **kwargs):
        raise ResponseError("NOPERM this user has no permissions to access the 'x' key")

    monkeypatch.setattr(runner_module, "trim", refused)
    runner = Runner(Consumer(bus, bus.keys.prompts, GROUP_RAAS, "c"), lambda e: [], 1)
    bus.settings = bus.settings.model_copy(update={"trim_interval_ms": 10})
    with capture_logs() as logs:
        task = asyncio.create_task(runner._trim_loop())
        await asyncio.sleep(0.05)
        task.cancel()
    [first, *_] = [e for e in logs if e["event"] == "trim_failed"]
    assert first["error"] == "ResponseError: NOPERM this user has no permissions to access the 'x' key"

"""`astraflow health`: ready or alive from a worker's consumer and heartbeat, else the reason."""

import asyncio
import socket
import time

import pytest

from astraflow.config import Settings
from astraflow.launch.worker_loop import process_name
from astraflow.messages import Heartbeat, encode
from astraflow.ops.health import Unhealthy, check, probe
from astraflow.streams.identity import mark_stopped
from astraflow.streams.keys import GROUP_DATAFLOW, GROUP_RAAS, GROUP_TRAINER
from astraflow.workflows import isolation


@pytest.fixture
def settings():
    return Settings(run={"name": "t"})


async def read_as(bus, stream, group, name):
    await bus.ensure_group(stream, group)
    await bus.redis.xreadgroup(group, name, {stream: ">"}, count=1)


async def beat(bus, wid, age_s=0.0):
    hb = Heartbeat(
        uid=wid, region="a", capacity=2, in_flight=0, versions={}, endpoint=None,
        started_at=time.time() - 60, updated_at=time.time() - age_s,
    )  # fmt: skip
    await bus.redis.hset(bus.keys.raas(wid), mapping=encode(hb))


async def test_a_dataflow_replica_that_reads_is_ready_and_found_by_its_host(bus, settings):
    name = process_name("dataflow")  # the default name, as the replica on this host holds it
    await read_as(bus, bus.keys.rollouts, GROUP_DATAFLOW, name)
    line = await check(bus, settings, "dataflow")
    assert line.startswith("ready:") and name in line


async def test_a_replica_that_stopped_reading_is_unhealthy_past_the_bound(bus, settings):
    await read_as(bus, bus.keys.rollouts, GROUP_DATAFLOW, "df-1")
    await asyncio.sleep(0.05)
    with pytest.raises(Unhealthy, match="df-1 last read rollouts"):
        await check(bus, settings, "dataflow", name="df-1", live=True, max_idle_s=0.01)
    assert (await check(bus, settings, "dataflow", name="df-1", live=True)).startswith("alive:")


async def test_no_consumer_of_that_name_is_unhealthy(bus, settings):
    await read_as(bus, bus.keys.rollouts, GROUP_DATAFLOW, "df-1")
    with pytest.raises(Unhealthy, match="no consumer df-2 in group 'dataflow'"):
        await check(bus, settings, "dataflow", name="df-2")
    with pytest.raises(Unhealthy, match=f"no consumer dataflow-{socket.gethostname()}-\\*"):
        await check(bus, settings, "dataflow")


async def test_a_stopped_or_missing_run_is_not_ready(bus, settings):
    await read_as(bus, bus.keys.rollouts, GROUP_DATAFLOW, "df-1")
    await mark_stopped(bus)
    with pytest.raises(Unhealthy, match="run 't' was stopped"):
        await check(bus, settings, "dataflow", name="df-1")
    await bus.redis.delete(bus.keys.identity)
    with pytest.raises(Unhealthy, match="does not exist"):
        await check(bus, settings, "dataflow", name="df-1")


async def test_the_trainer_is_seen_as_trainer_of_its_policy(bus, settings):
    with pytest.raises(Unhealthy, match="no consumer trainer-policy"):
        await check(bus, settings, "trainer")
    await read_as(bus, bus.keys.batches("policy"), GROUP_TRAINER, "trainer-policy")
    assert "trainer-policy read batches:policy" in await check(bus, settings, "trainer")


async def test_a_raas_is_judged_by_its_heartbeat(bus, settings):
    settings.raas.id = "r1"  # as ASTRAFLOW_RAAS__ID sets it for both the worker and its probe
    await read_as(bus, bus.keys.prompts, GROUP_RAAS, "r1")
    with pytest.raises(Unhealthy, match="no heartbeat raas:r1"):
        await check(bus, settings, "raas")
    await beat(bus, "r1")
    line = await check(bus, settings, "raas")
    assert "r1" in line and f"tool sandbox: {isolation.mode().name}" in line
    await beat(bus, "r1", age_s=3 * settings.raas.heartbeat_ms / 1000 + 1)
    with pytest.raises(Unhealthy, match="heartbeat raas:r1 is 16s old"):
        await check(bus, settings, "raas", live=True)


async def test_a_raas_line_says_when_the_sandbox_would_refuse_the_worker(bus, settings, monkeypatch):
    settings.raas.id = "r1"
    await read_as(bus, bus.keys.prompts, GROUP_RAAS, "r1")
    await beat(bus, "r1")
    why = "user-namespaces: unshare: unshare failed: Operation not permitted"
    monkeypatch.setattr(isolation, "mode", lambda: isolation.Mode(isolation.NONE, why))
    assert (await check(bus, settings, "raas")).endswith(
        f"tool sandbox: none, refused (tool calls are refused: raas.sandbox is namespaces): {why}"
    )  # the default recipe's workflow runs no tool: the worker starts, a tool call it gets is refused
    settings.dataflow.feeder.workflow = "multi_turn"
    assert (await check(bus, settings, "raas")).endswith(
        f"tool sandbox: none, refused (a RaaS will not start: raas.sandbox is namespaces): {why}"
    )
    settings.raas.sandbox = "none"
    assert "tool sandbox: none (tools run as the worker's user, unisolated" in await check(
        bus, settings, "raas"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_without_redis_a_worker_is_not_ready_but_not_restarted_either(settings):
    settings.redis.reconnect_max_s = 0.2
    url = f"redis://127.0.0.1:{free_port()}/0"
    ok, line = await probe(settings, url, "dataflow")
    assert not ok and line.startswith("unhealthy: redis unreachable")
    ok, line = await probe(settings, url, "dataflow", live=True)
    assert ok and "not judged" in line

"""One dataflow replica alone on a real Redis: a step that fails to settle is retried by that replica."""

from __future__ import annotations

import pytest

from astraflow.dataflow.ledger import read_ledger
from astraflow.dataflow.service import Dataflow
from astraflow.errors import BusConnectionError, BusError
from astraflow.launch.build import dataflow_setup
from astraflow.settings_load import load_settings
from astraflow.streams.keys import GROUP_DATAFLOW
from tests.dataflow_helpers import heartbeat, publish_version, roll_out

pytestmark = pytest.mark.integration
STEPS = 20


def single_replica(bus) -> Dataflow:
    settings = load_settings(None, ["run.name=it", "dataflow.feeder.n_samples=4", "dataflow.batch.size=8"])
    return Dataflow(dataflow_setup(settings), bus, "df-only")


def fail_once(obj, name: str, error: Exception) -> list:
    """Make `obj.name` raise `error` on its first call; returns the list of calls that failed."""
    real, failed = getattr(obj, name), []

    async def call(*args, **kwargs):
        if not failed:
            failed.append(args)
            raise error
        return await real(*args, **kwargs)

    setattr(obj, name, call)
    return failed


async def pending(bus, stream: str) -> int:
    return (await bus.redis.xpending(stream, GROUP_DATAFLOW))["pending"]


@pytest.mark.parametrize(
    "error", [BusError("hand-off refused: ERR injected"), BusConnectionError("redis unreachable for 1s")]
)
async def test_a_collect_that_failed_once_is_collected_by_the_same_single_replica(bus, error):
    df = single_replica(bus)
    await heartbeat(bus, "sim", 8)
    await df.feeder.step()
    uids = await roll_out(bus, 100, lambda g, i: float(i % 2))
    failed = fail_once(df.store, "collect", error)
    with pytest.raises(type(error)):
        await df.collector.step(10)
    assert failed
    for _ in range(STEPS):
        if not await df.collector.step(10) and not await pending(bus, bus.keys.rollouts):
            break
    ledger = await read_ledger(bus, ["policy"])
    assert ledger.collected == len(uids) > 0 and not ledger.problems(), ledger.render()
    assert await pending(bus, bus.keys.rollouts) == 0
    assert await bus.redis.xlen(bus.keys.dead) == 0
    assert await bus.redis.hlen(bus.keys.errors) == 0  # what the failure recorded went with the ack


async def test_entries_read_while_a_failed_collect_was_committing_are_collected_too(bus):
    """The collector reads the next entries while the last ones are committed: when that commit fails,
    the entries just read are handed back as well, not left held by a loop that ended."""
    df = single_replica(bus)
    df.collector.settings.read_count = 2  # two reads: one committing, one waiting for it
    await heartbeat(bus, "sim", 8)
    await df.feeder.step()
    uids = await roll_out(bus, 4, lambda g, i: float(i % 2))
    fail_once(df.store, "collect", BusError("hand-off refused: ERR injected"))
    with pytest.raises(BusError):
        await df._collect()
    for _ in range(STEPS):
        if not await df.collector.step(10) and not await pending(bus, bus.keys.rollouts):
            break
    ledger = await read_ledger(bus, ["policy"])
    assert ledger.collected == len(uids) == 4 and not ledger.problems(), ledger.render()
    assert await pending(bus, bus.keys.rollouts) == 0


async def test_a_version_whose_recording_failed_once_is_recorded_by_the_same_single_replica(bus):
    df = single_replica(bus)
    await publish_version(bus, "policy", 1)
    fail_once(df.store, "record_version", BusError("injected"))
    with pytest.raises(BusError):
        await df.barrier.step(10)
    for _ in range(STEPS):
        if not await df.barrier.step(10) and not await pending(bus, bus.keys.versions):
            break
    assert (await df.store.state()).get("v:policy") == "1"
    assert await pending(bus, bus.keys.versions) == 0
    assert await bus.redis.hlen(bus.keys.errors) == 0


async def test_a_version_delivered_by_a_read_whose_reply_was_lost_is_recorded_within_the_lease(bus):
    """Redis delivered a version entry to the barrier (it is in the group's pending list under the
    replica's name) and the reply never reached the replica: no later read of that replica failed, so
    nothing told it to look. A single replica must still take the entry back and record it, instead of
    leaving it pending for the rest of the run (nobody else would ever claim it)."""
    df = single_replica(bus)
    await df.barrier.step(10)  # running: its start-up scan of its own pending entries is behind it
    await publish_version(bus, "policy", 1)
    name = df.barrier.consumer.name
    await bus.redis.xreadgroup(GROUP_DATAFLOW, name, {bus.keys.versions: ">"}, count=10)  # reply lost
    assert await pending(bus, bus.keys.versions) == 1
    for _ in range(4 * bus.settings.lease_ms // bus.settings.block_ms):  # (a read blocks block_ms)
        await df.barrier.step(bus.settings.block_ms)
        if not await pending(bus, bus.keys.versions):
            break
    assert await pending(bus, bus.keys.versions) == 0
    assert (await df.store.state()).get("v:policy") == "1"
    assert await bus.redis.xlen(bus.keys.dead) == 0

"""The trainer's batch reader on fakeredis: batches with their samples, leases, owner-checked acks."""

import asyncio

import numpy as np

from astraflow.dataflow.batches import BatchReader
from astraflow.dataflow.service import Dataflow
from astraflow.launch.build import dataflow_setup
from astraflow.messages import SCHEMA_VERSION
from astraflow.settings_load import load_settings
from astraflow.streams.keys import GROUP_TRAINER
from tests.dataflow_helpers import SMALL_RUN, roll_out


async def put_batch(bus, n: int, fields=None) -> str:
    """Batch `n` as the dataflow forms it (form.lua: its groups' bytes in `samples:policy`, refs in the
    entry), from two fresh prompt groups rolled out with rewards 0 and 1; or an entry of `fields`."""
    if fields is not None:
        return (await bus.redis.xadd(bus.keys.batches("policy"), fields)).decode()
    overrides = ["dataflow.batch.size=4", "dataflow.batch.prefetch=8", "dataflow.feeder.min_backlog=2"]
    df = Dataflow(dataflow_setup(load_settings(None, [*SMALL_RUN, *overrides])), bus, "df")
    await df.feeder.step()
    await roll_out(bus, 2, lambda g, i: float(i % 2))
    while await df.collector.step(1):
        pass
    assert await df.former.step("policy") == "ok"
    [(entry_id, _)] = await bus.redis.xrevrange(bus.keys.batches("policy"), count=1)
    return entry_id.decode()


async def test_read_hands_out_batches_with_their_samples(bus):
    reader = BatchReader(bus, "policy", "trainer-policy")
    await reader.open()
    ids = [await put_batch(bus, n) for n in (1, 2)]
    got = await reader.read(2, block_ms=10)
    assert [r.id for r in got] == ids
    assert [r.batch.uid.rsplit(":", 1)[1] for r in got] == ["1", "2"]
    assert [len(r.batch.groups) for r in got] == [2, 2]
    assert not {g.uid for g in got[0].batch.groups} & {g.uid for g in got[1].batch.groups}
    assert np.allclose(got[0].batch.groups[0].advantages, [-1, 1], atol=1e-5)  # rewards 0, 1 normalised
    assert await reader.read(1, block_ms=10) == []


async def test_an_undecodable_batch_is_dead_lettered_not_handed_out(bus):
    reader = BatchReader(bus, "policy", "trainer-policy")
    bad = await put_batch(
        bus, 1, {"kind": "batch", "schema": str(SCHEMA_VERSION), "uid": "x", "refs": "nowhere"}
    )
    good = await put_batch(bus, 2)
    assert [r.id for r in await reader.read(2, block_ms=10)] == [good]
    [(_, dead)] = await bus.redis.xrange(bus.keys.dead)
    assert dead[b"source_id"].decode() == bad
    assert (await bus.redis.xpending(bus.keys.batches("policy"), GROUP_TRAINER))["pending"] == 1


async def test_a_restarted_reader_gets_its_unacknowledged_batches_back_and_acks_them(bus):
    await put_batch(bus, 1)
    [held] = await BatchReader(bus, "policy", "trainer-policy").read(1, block_ms=10)
    again = BatchReader(bus, "policy", "trainer-policy")  # the same name after a crash
    [back] = await again.read(1, block_ms=10)
    assert back.id == held.id and back.batch.uid.endswith(":1")
    assert await again.ack([back]) == []
    assert (await bus.redis.xpending(bus.keys.batches("policy"), GROUP_TRAINER))["pending"] == 0


async def test_renewed_batches_are_not_reclaimed_and_lost_ones_are_reported(bus):
    await put_batch(bus, 1)
    owner = BatchReader(bus, "policy", "trainer-a")
    other = BatchReader(bus, "policy", "trainer-b")
    [held] = await owner.read(1, block_ms=10)
    for _ in range(4):  # more than a lease, renewed every third of one
        await asyncio.sleep(bus.settings.lease_ms / 3000)
        assert await owner.renew() == []
        assert await other.read(1, block_ms=10) == []
    await asyncio.sleep(bus.settings.lease_ms / 1000 + 0.05)  # not renewed: the other reclaims it
    other._consumer._next_reclaim = 0
    [taken] = await other.read(1, block_ms=10)
    assert taken.id == held.id
    assert await owner.renew() == [held.id]


async def test_an_ack_of_a_batch_another_reader_reclaimed_is_refused(bus):
    await put_batch(bus, 1)
    slow = BatchReader(bus, "policy", "trainer-a")
    fast = BatchReader(bus, "policy", "trainer-b")
    [held] = await slow.read(1, block_ms=10)
    await asyncio.sleep(bus.settings.lease_ms / 1000 + 0.05)
    [taken] = await fast.read(1, block_ms=10)
    assert await slow.ack([held]) == [held.id]
    pending = await bus.redis.xpending_range(bus.keys.batches("policy"), GROUP_TRAINER, "-", "+", 10)
    assert [p["consumer"] for p in pending] == [b"trainer-b"]  # still the new owner's, unacknowledged
    assert await fast.ack([taken]) == []
    assert (await bus.redis.xpending(bus.keys.batches("policy"), GROUP_TRAINER))["pending"] == 0


async def test_acknowledged_batches_are_trimmed(bus):
    reader = BatchReader(bus, "policy", "trainer-policy")
    for n in (1, 2, 3):
        await put_batch(bus, n)
    got = await reader.read(3, block_ms=10)
    await asyncio.sleep(bus.settings.trim_interval_ms / 1000)
    await reader.ack(got[:2])
    assert [i.decode() for i, _ in await bus.redis.xrange(bus.keys.batches("policy"))] == [got[2].id]

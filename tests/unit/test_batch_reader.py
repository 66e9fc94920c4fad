"""The trainer's batch reader on fakeredis: batches with their samples, leases, owner-checked acks."""

import asyncio

import numpy as np

from astraflow.dataflow.batches import BatchReader
from astraflow.messages import Batch, RolloutGroup, SampleGroup, Trajectory, encode_batch, pack
from astraflow.streams.keys import GROUP_TRAINER


def group(uid: str) -> SampleGroup:
    traj = Trajectory(
        model="policy",
        token_ids=np.array([1, 2, 3], np.int32),
        logprobs=np.array([0, -0.5, -0.7], np.float32),
        loss_mask=np.array([0, 1, 1], np.uint8),
        versions=np.array([-1, 0, 0], np.int32),
        reward=1.0,
    )
    rollout = RolloutGroup(uid=uid, raas="r", version=0, trajectories=[traj])
    return SampleGroup(uid, "policy", 0, 0, pack(rollout), [0], np.array([0.5], np.float32))


async def put_batch(bus, n: int, fields=None) -> str:
    """A batch entry as the dataflow forms it: its groups' bytes in `samples:policy`, refs in the entry."""
    groups = [group(f"b{n}g{i}") for i in range(2)]
    refs = [f"ref-{n}-{i}" for i in range(2)]
    samples = {r: pack(g) for r, g in zip(refs, groups, strict=True)}
    await bus.redis.hset(bus.keys.samples("policy"), mapping=samples)
    batch = Batch(uid=f"policy:{n}", model="policy", version=n, groups=groups)
    return (await bus.redis.xadd(bus.keys.batches("policy"), fields or encode_batch(batch, refs))).decode()


async def test_read_hands_out_batches_with_their_samples(bus):
    reader = BatchReader(bus, "policy", "trainer-policy")
    await reader.open()
    ids = [await put_batch(bus, n) for n in (1, 2)]
    got = await reader.read(2, block_ms=10)
    assert [r.id for r in got] == ids
    assert [r.batch.uid for r in got] == ["policy:1", "policy:2"]
    assert [g.uid for g in got[1].batch.groups] == ["b2g0", "b2g1"]
    assert got[0].batch.groups[0].advantages.tolist() == [0.5]
    assert await reader.read(1, block_ms=10) == []


async def test_an_undecodable_batch_is_dead_lettered_not_handed_out(bus):
    reader = BatchReader(bus, "policy", "trainer-policy")
    bad = await put_batch(bus, 1, {"kind": "batch", "schema": "1", "uid": "x", "refs": "nowhere"})
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
    assert back.id == held.id and back.batch.uid == "policy:1"
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

"""A call with many entries goes to Redis as several within `streams.max_call_args` / `max_call_bytes`,
and keeps its promises per entry: each published once (also when published again), every hand-off,
acknowledgement and renewal done."""

from astraflow.streams import DUP, OK, Consumer, Out
from astraflow.streams.chunks import CALL_ARGS, chunked
from astraflow.streams.keys import GROUP_RAAS


def test_chunks_keep_order_and_limits_and_never_split_an_item():
    sizes = [(10, 100), (10, 100), (500, 10), (10, 6000), (10, 100)]
    max_args = CALL_ARGS + 25
    runs = list(chunked(range(len(sizes)), sizes.__getitem__, max_args, 10_000))
    assert runs == [[0, 1], [2], [3], [4]]  # 2 and 3: over a limit by themselves, each a call alone
    assert list(chunked([], sizes.__getitem__, max_args, 10_000)) == []


async def test_publish_many_past_the_call_limits_publishes_each_entry_once(bus):
    bus.settings.max_call_args = 200  # a few entries a call
    outs = [Out(bus.keys.prompts, {"uid": f"u{i}", "data": b"x" * 10}, f"p{i}") for i in range(500)]
    ids = await bus.publish_many(outs)
    stored = [entry_id.decode() for entry_id, _ in await bus.redis.xrange(bus.keys.prompts)]
    assert ids == stored and len(stored) == 500  # all of them, in order
    assert await bus.publish_many(outs) == ids  # published again: nothing twice
    assert await bus.redis.xlen(bus.keys.prompts) == 500


async def test_large_entries_go_in_calls_within_the_byte_limit(bus):
    bus.settings.max_call_bytes = 1 << 20
    outs = [Out(bus.keys.prompts, {"data": bytes([i]) * (300 << 10)}, f"p{i}") for i in range(10)]
    ids = await bus.publish_many(outs)
    stored = await bus.redis.xrange(bus.keys.prompts)
    assert [entry_id.decode() for entry_id, _ in stored] == ids
    assert [fields[b"data"][:1] for _, fields in stored] == [bytes([i]) for i in range(10)]


async def test_hand_offs_acks_and_renewals_of_many_entries_all_happen(bus):
    bus.settings.max_call_args = 100
    await bus.publish_many([Out(bus.keys.prompts, {"uid": f"u{i}"}, f"p{i}") for i in range(300)])
    c = Consumer(bus, bus.keys.prompts, GROUP_RAAS, "c1")
    entries = await c.read(300, block_ms=10)
    assert await bus.renew(bus.keys.prompts, GROUP_RAAS, "c1", [e.id for e in entries]) == []
    other = [e.id for e in entries[:150]]
    assert await bus.renew(bus.keys.prompts, GROUP_RAAS, "c2", other) == other  # c2 owns none of them
    done = [(e, [Out(bus.keys.rollouts, {"uid": f"r{i}"}, f"r{i}")]) for i, e in enumerate(entries[:200])]
    assert await c.complete(done) == [OK] * 200
    assert await c.complete(done) == [DUP] * 200
    await bus.ack(bus.keys.prompts, GROUP_RAAS, [e.id for e in entries[200:]])
    assert await bus.redis.xlen(bus.keys.rollouts) == 200
    assert (await bus.redis.xpending(bus.keys.prompts, GROUP_RAAS))["pending"] == 0

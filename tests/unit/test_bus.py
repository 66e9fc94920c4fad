"""The bus's guarantees on fakeredis: idempotent publish, owner-checked hand-off, leases, reclaim, trim."""

import asyncio

import pytest

from astraflow.errors import BusError, MessageTooLarge
from astraflow.streams import DUP, LOST, OK, Consumer, Out
from astraflow.streams.keys import GROUP_DATAFLOW, GROUP_RAAS
from astraflow.streams.reap import Reaper
from astraflow.streams.trim import trim


def out(bus, i, dedup=True):
    return Out(bus.keys.prompts, {"uid": f"u{i}", "data": b"x" * 10}, f"p{i}" if dedup else None)


async def fill(bus, n):
    return await bus.publish_many([out(bus, i) for i in range(n)])


async def test_publish_with_same_dedup_key_publishes_once(bus):
    first = await bus.publish(out(bus, 1))
    again = await bus.publish(out(bus, 1))
    assert first == again
    assert await bus.redis.xlen(bus.keys.prompts) == 1


async def test_publish_without_dedup_key_publishes_each_time(bus):
    await bus.publish(out(bus, 1, dedup=False))
    await bus.publish(out(bus, 1, dedup=False))
    assert await bus.redis.xlen(bus.keys.prompts) == 2


async def test_oversized_entry_is_refused(bus):
    bus.settings.max_entry_bytes = 100
    with pytest.raises(MessageTooLarge, match="max_entry_bytes"):
        await bus.publish(Out(bus.keys.prompts, {"data": b"x" * 101}))


async def test_consumer_reads_at_most_its_capacity(bus):
    await fill(bus, 5)
    c = Consumer(bus, bus.keys.prompts, GROUP_RAAS, "c1")
    assert len(await c.read(2, block_ms=10)) == 2
    assert len(await c.read(10, block_ms=10)) == 3
    assert await c.read(10, block_ms=10) == []


async def test_handoff_acks_and_publishes_together(bus):
    await fill(bus, 1)
    c = Consumer(bus, bus.keys.prompts, GROUP_RAAS, "c1")
    [entry] = await c.read(1, block_ms=10)
    result = Out(bus.keys.rollouts, {"data": b"r"}, "r1")
    assert await c.complete([(entry, [result])]) == [OK]
    assert await bus.redis.xlen(bus.keys.rollouts) == 1
    assert (await bus.redis.xpending(bus.keys.prompts, GROUP_RAAS))["pending"] == 0
    # A retry of the same call (its reply lost) changes nothing.
    assert await c.complete([(entry, [result])]) == [DUP]
    assert await bus.redis.xlen(bus.keys.rollouts) == 1


async def test_handoff_of_a_reclaimed_entry_is_lost_and_writes_nothing(bus):
    await fill(bus, 1)
    slow = Consumer(bus, bus.keys.prompts, GROUP_RAAS, "slow")
    fast = Consumer(bus, bus.keys.prompts, GROUP_RAAS, "fast")
    [entry] = await slow.read(1, block_ms=10)
    await asyncio.sleep(bus.settings.lease_ms / 1000 + 0.05)
    [taken] = await fast.read(1, block_ms=10)
    assert taken.id == entry.id and taken.deliveries == 2
    assert await slow.complete([(entry, [Out(bus.keys.rollouts, {"data": b"late"}, "late")])]) == [LOST]
    assert await bus.redis.xlen(bus.keys.rollouts) == 0
    assert await fast.complete([(taken, [Out(bus.keys.rollouts, {"data": b"r"}, "r")])]) == [OK]
    assert await bus.redis.xlen(bus.keys.rollouts) == 1


async def test_handoff_of_an_entry_never_delivered_is_lost_not_dup(bus):
    """After a failover the promoted replica may lack a read: its entry is neither pending nor acknowledged
    there, and a hand-off of it is LOST (nothing written, the entry is read anew), not DUP ("done")."""
    await fill(bus, 3)
    c = Consumer(bus, bus.keys.prompts, GROUP_RAAS, "c")
    first, _ = await c.read(2, block_ms=10)
    assert await c.complete([(first, [Out(bus.keys.rollouts, {"data": b"r"})])]) == [OK]
    ids = [entry_id.decode() for entry_id, _ in await bus.redis.xrange(bus.keys.prompts)]
    unread = ids[2]  # (the group's last-delivered id is ids[1])
    replies = await bus.handoff(
        bus.keys.prompts, GROUP_RAAS, "c", [(unread, [Out(bus.keys.rollouts, {"d": b"x"})])]
    )
    assert [status for status, _ in replies] == [LOST]
    assert await bus.redis.xlen(bus.keys.rollouts) == 1
    assert [e.id for e in await c.read(5, block_ms=10)] == [unread]
    assert await c.complete([(first, [Out(bus.keys.rollouts, {"data": b"r"})])]) == [DUP]  # acknowledged


async def test_handoff_of_an_entry_this_server_never_had_is_lost_even_after_later_reads(bus):
    """A failover may lose an entry's XADD too: later entries are delivered past its id, yet a hand-off of
    it is LOST; one trimmed away after its acknowledgement is still DUP."""
    for entry_id in ("5-0", "7-0"):
        await bus.redis.xadd(bus.keys.prompts, {"data": b"x"}, id=entry_id)
    c = Consumer(bus, bus.keys.prompts, GROUP_RAAS, "c")
    first, _ = await c.read(2, block_ms=10)
    assert await c.complete([(first, [Out(bus.keys.rollouts, {"data": b"r"})])]) == [OK]
    never = await bus.handoff(
        bus.keys.prompts, GROUP_RAAS, "c", [("6-0", [Out(bus.keys.rollouts, {"d": b"x"})])]
    )
    assert [status for status, _ in never] == [LOST]
    await bus.redis.xtrim(bus.keys.prompts, minid="7-0")
    assert await c.complete([(first, [Out(bus.keys.rollouts, {"data": b"r"})])]) == [DUP]
    assert await bus.redis.xlen(bus.keys.rollouts) == 1


async def test_handoff_of_a_batch_tells_owned_entries_from_held_elsewhere_and_repeated(bus):
    """Owners are checked for the whole call at once: between a call's lowest and highest input other
    consumers' entries and this consumer's entries outside the call change nothing, and an input given
    twice in one call is handed off once."""
    await fill(bus, 6)
    a = Consumer(bus, bus.keys.prompts, GROUP_RAAS, "a")
    b = Consumer(bus, bus.keys.prompts, GROUP_RAAS, "b")
    e0, e1 = await a.read(2, block_ms=10)
    [e2] = await b.read(1, block_ms=10)
    e3, e4, e5 = await a.read(3, block_ms=10)

    def result(e):
        return [Out(bus.keys.rollouts, {"from": e.id})]

    statuses = await a.complete([(e0, result(e0)), (e2, result(e2)), (e4, result(e4)), (e4, result(e4))])
    assert statuses == [OK, LOST, OK, DUP]
    written = [f[b"from"].decode() for _, f in await bus.redis.xrange(bus.keys.rollouts)]
    assert written == [e0.id, e4.id]
    pending = await bus.redis.xpending_range(bus.keys.prompts, GROUP_RAAS, "-", "+", 10)
    assert {(p["message_id"].decode(), p["consumer"].decode()) for p in pending} == {
        (e1.id, "a"),
        (e2.id, "b"),
        (e3.id, "a"),
        (e5.id, "a"),
    }


async def test_handoff_checks_output_types_before_writing(bus):
    await fill(bus, 1)
    await bus.redis.set(bus.keys.rollouts + "x", "not a stream")
    c = Consumer(bus, bus.keys.prompts, GROUP_RAAS, "c1")
    [entry] = await c.read(1, block_ms=10)
    outs = [Out(bus.keys.rollouts, {"data": b"ok"}, "a"), Out(bus.keys.rollouts + "x", {"data": b"bad"}, "b")]
    with pytest.raises(BusError, match="WRONGTYPE"):
        await c.complete([(entry, outs)])
    assert await bus.redis.xlen(bus.keys.rollouts) == 0
    assert (await bus.redis.xpending(bus.keys.prompts, GROUP_RAAS))["pending"] == 1


async def test_renewal_keeps_an_entry_from_being_reclaimed(bus):
    await fill(bus, 1)
    owner = Consumer(bus, bus.keys.prompts, GROUP_RAAS, "owner")
    other = Consumer(bus, bus.keys.prompts, GROUP_RAAS, "other")
    [entry] = await owner.read(1, block_ms=10)
    for _ in range(6):  # two leases' worth of time
        await asyncio.sleep(bus.settings.lease_ms / 3000)
        assert await owner.renew() == []
        other._next_reclaim = 0
        assert await other.read(1, block_ms=10) == []
    assert entry.id in owner.in_flight


async def test_renewal_never_takes_back_a_reclaimed_entry(bus):
    await fill(bus, 1)
    owner = Consumer(bus, bus.keys.prompts, GROUP_RAAS, "owner")
    other = Consumer(bus, bus.keys.prompts, GROUP_RAAS, "other")
    [entry] = await owner.read(1, block_ms=10)
    await asyncio.sleep(bus.settings.lease_ms / 1000 + 0.05)
    assert len(await other.read(1, block_ms=10)) == 1
    assert [e.id for e in await owner.renew()] == [entry.id]
    pending = await bus.redis.xpending_range(bus.keys.prompts, GROUP_RAAS, "-", "+", 10)
    assert [p["consumer"] for p in pending] == [b"other"]


async def test_restarted_consumer_rereads_its_own_pending_entries_first(bus):
    await fill(bus, 3)
    first = Consumer(bus, bus.keys.prompts, GROUP_RAAS, "w")
    held = await first.read(2, block_ms=10)
    again = Consumer(bus, bus.keys.prompts, GROUP_RAAS, "w")  # same name after a restart
    again._next_reclaim = float("inf")
    got = await again.read(3, block_ms=10)
    assert [e.id for e in got[:2]] == [e.id for e in held]
    assert len(got) == 3


async def test_released_entry_dead_letters_after_max_deliveries(bus):
    await fill(bus, 1)
    c = Consumer(bus, bus.keys.prompts, GROUP_RAAS, "c")
    seen = 0
    for _ in range(bus.settings.max_deliveries + 2):
        c._next_reclaim = 0
        for entry in await c.read(1, block_ms=10):
            seen += 1
            await c.release(entry, "ValueError: always fails")
    assert seen == bus.settings.max_deliveries
    # A RaaS leaves it pending (its user may not write `dead`): the dataflow dead-letters it.
    assert await bus.redis.xlen(bus.keys.dead) == 0
    assert await Reaper(bus).sweep(bus.keys.prompts) == 1
    [(_, dead)] = await bus.redis.xrange(bus.keys.dead)
    assert dead[b"source"] == bus.keys.prompts.encode()
    assert dead[b"consumer"] == b"c"
    assert b"ValueError: always fails" in dead[b"reason"]
    assert dead[b"field.uid"] == b"u0"
    assert (await bus.redis.xpending(bus.keys.prompts, GROUP_RAAS))["pending"] == 0


async def test_dead_letter_is_immediate_and_acks(bus):
    await bus.publish(Out(bus.keys.rollouts, {"data": b"x"}))
    c = Consumer(bus, bus.keys.rollouts, GROUP_DATAFLOW, "c")
    [entry] = await c.read(1, block_ms=10)
    await c.dead_letter(entry, "DecodeError: kind: missing header field")
    [(_, dead)] = await bus.redis.xrange(bus.keys.dead)
    assert dead[b"reason"].startswith(b"DecodeError")
    assert (await bus.redis.xpending(bus.keys.rollouts, GROUP_DATAFLOW))["pending"] == 0


async def test_trim_never_drops_unacknowledged_entries(bus):
    ids = await fill(bus, 6)
    c = Consumer(bus, bus.keys.prompts, GROUP_RAAS, "c")
    got = await c.read(4, block_ms=10)  # 0..3 delivered, 4..5 undelivered
    await c.complete([(got[0], []), (got[2], [])])  # 0 and 2 acked, 1 and 3 pending
    assert await trim(bus, bus.keys.prompts) == 1  # only entry 0
    left = [i.decode() for i, _ in await bus.redis.xrange(bus.keys.prompts)]
    assert left == ids[1:]
    await c.complete([(got[1], []), (got[3], [])])
    assert await trim(bus, bus.keys.prompts) == 3
    left = [i.decode() for i, _ in await bus.redis.xrange(bus.keys.prompts)]
    assert left == ids[4:]


async def test_trim_ignores_a_consumer_group_the_run_does_not_know(bus):
    ids = await fill(bus, 3)
    await bus.redis.xgroup_create(bus.keys.prompts, "evil", id="0")  # anyone allowed XGROUP CREATE
    c = Consumer(bus, bus.keys.prompts, GROUP_RAAS, "c")
    got = await c.read(2, block_ms=10)
    await c.complete([(e, []) for e in got])
    assert await trim(bus, bus.keys.prompts) == 2  # "evil" has read nothing: it holds nothing back
    assert [i.decode() for i, _ in await bus.redis.xrange(bus.keys.prompts)] == ids[2:]


async def test_deleted_pending_entry_is_acknowledged_not_delivered(bus):
    ids = await fill(bus, 2)
    c = Consumer(bus, bus.keys.prompts, GROUP_RAAS, "c")
    await c.read(2, block_ms=10)
    await bus.redis.xdel(bus.keys.prompts, ids[0])
    again = Consumer(bus, bus.keys.prompts, GROUP_RAAS, "c")
    again._next_reclaim = float("inf")
    assert [e.id for e in await again.read(5, block_ms=10)] == [ids[1]]
    assert (await bus.redis.xpending(bus.keys.prompts, GROUP_RAAS))["pending"] == 1


async def test_bootstrap_is_idempotent_and_recreates_lost_groups(bus):
    await bus.bootstrap(["policy", "verifier"])
    await bus.bootstrap(["policy", "verifier"])
    groups = await bus.redis.xinfo_groups(bus.keys.batches("verifier"))
    assert [g["name"] for g in groups] == [b"trainer"]
    await bus.redis.delete(bus.keys.prompts)
    await fill(bus, 1)
    c = Consumer(bus, bus.keys.prompts, GROUP_RAAS, "c")
    assert len(await c.read(1, block_ms=10)) == 1  # NOGROUP -> group recreated from id 0


async def test_restart_under_the_same_name_takes_each_entry_back_once(bus):
    await fill(bus, 3)
    before = Consumer(bus, bus.keys.prompts, GROUP_RAAS, "w")
    held = await before.read(3, block_ms=10)
    await asyncio.sleep(bus.settings.lease_ms / 1000 + 0.05)  # the old process is gone: no renewals
    after = Consumer(bus, bus.keys.prompts, GROUP_RAAS, "w")
    got = await after.read(10, block_ms=10)
    assert sorted(e.id for e in got) == sorted(e.id for e in held)
    assert all(e.deliveries == 2 for e in got)  # the crashed attempt counts
    assert await after.read(10, block_ms=10) == []  # not handed out a second time


async def test_rescan_after_a_lost_reply_does_not_count_held_entries_again(bus):
    await fill(bus, 2)
    c = Consumer(bus, bus.keys.prompts, GROUP_RAAS, "c")
    held = await c.read(2, block_ms=10)
    for _ in range(3):
        c.rescan()  # what a lost connection does
        assert await c.read(5, block_ms=10) == []
    pending = await bus.redis.xpending_range(bus.keys.prompts, GROUP_RAAS, "-", "+", 10)
    assert [p["times_delivered"] for p in pending] == [1, 1]
    assert set(c.in_flight) == {e.id for e in held}


async def test_entry_the_consumer_lost_track_of_is_taken_back_by_itself_without_counting(bus):
    await fill(bus, 1)
    c = Consumer(bus, bus.keys.prompts, GROUP_RAAS, "c")
    [entry] = await c.read(1, block_ms=10)
    c.forget(entry.id)  # e.g. its hand-off failed while Redis was away: not the entry's fault
    [again] = await c.read(1, block_ms=10)
    assert again.id == entry.id and again.deliveries == 1


async def test_entry_delivered_by_a_read_whose_reply_never_came_is_taken_back_without_counting(bus):
    c = Consumer(bus, bus.keys.prompts, GROUP_RAAS, "c")
    assert await c.read(1, block_ms=10) == []  # running: its start-up scan of its own entries is done
    await fill(bus, 1)
    await bus.redis.xreadgroup(GROUP_RAAS, "c", {bus.keys.prompts: ">"}, count=1)  # the reply is lost
    got = []
    for _ in range(4 * bus.settings.lease_ms // 10):  # (each empty read blocks 10 ms)
        if got := await c.read(1, block_ms=10):
            break
    assert [(e.deliveries, e.id in c.in_flight) for e in got] == [(1, True)]


async def test_invalid_output_in_a_batch_writes_nothing(bus):
    await fill(bus, 2)
    c = Consumer(bus, bus.keys.prompts, GROUP_RAAS, "c")
    a, b = await c.read(2, block_ms=10)
    with pytest.raises(MessageTooLarge, match="0 fields"):
        await c.complete([(a, [Out(bus.keys.rollouts, {"data": b"ok"})]), (b, [Out(bus.keys.rollouts, {})])])
    too_many = {f"f{i}": b"" for i in range(1001)}
    with pytest.raises(MessageTooLarge, match="1001 fields"):
        await c.complete([(a, [Out(bus.keys.rollouts, too_many)])])
    assert await bus.redis.xlen(bus.keys.rollouts) == 0
    assert (await bus.redis.xpending(bus.keys.prompts, GROUP_RAAS))["pending"] == 2


async def test_handoff_retried_without_dedup_keys_is_still_exactly_once(bus):
    await fill(bus, 1)
    c = Consumer(bus, bus.keys.prompts, GROUP_RAAS, "c")
    [entry] = await c.read(1, block_ms=10)
    out = Out(bus.keys.rollouts, {"data": b"r"})  # no dedup key: the owner check is the guard
    [(first, _)] = await bus.handoff(bus.keys.prompts, GROUP_RAAS, "c", [(entry, [out])])
    [(retry, _)] = await bus.handoff(bus.keys.prompts, GROUP_RAAS, "c", [(entry, [out])])
    assert (first, retry) == (OK, DUP)
    assert await bus.redis.xlen(bus.keys.rollouts) == 1


async def test_dead_letter_of_an_entry_whose_owners_crashed_says_so(bus):
    await fill(bus, 1)
    for i in range(bus.settings.max_deliveries + 1):
        worker = Consumer(bus, bus.keys.prompts, GROUP_RAAS, f"w{i}")
        got = await worker.read(1, block_ms=10)
        assert len(got) == (i < bus.settings.max_deliveries)
        await asyncio.sleep(bus.settings.lease_ms / 1000 + 0.05)  # it crashed: nobody renews
    assert await Reaper(bus).sweep(bus.keys.prompts) == 1  # (no RaaS dead-letters: the dataflow does)
    [(_, dead)] = await bus.redis.xrange(bus.keys.dead)
    assert b"w2 stopped renewing its lease (crashed or hung)" in dead[b"reason"]


async def test_large_fields_of_a_dead_letter_are_replaced_by_size_and_digest(bus):
    await bus.publish(Out(bus.keys.rollouts, {"uid": b"u0", "data": b"x" * 100_000}))
    c = Consumer(bus, bus.keys.rollouts, GROUP_DATAFLOW, "c")
    [entry] = await c.read(1, block_ms=10)
    await c.dead_letter(entry, "DecodeError: data: truncated")
    for _ in range(bus.settings.max_deliveries):  # and the same through a claim after max_deliveries
        await bus.publish(Out(bus.keys.rollouts, {"uid": b"u1", "data": b"y" * 100_000}))
    c._next_reclaim = float("inf")
    for _ in range(bus.settings.max_deliveries + 1):
        for e in await c.read(1, block_ms=10):
            await c.release(e, "ValueError: nope")
    letters = [f for _, f in await bus.redis.xrange(bus.keys.dead)]
    assert letters[0][b"field.data"].startswith(b"omitted: 100000 bytes, sha1 ")
    assert letters[0][b"field.uid"] == b"u0"
    assert letters[1][b"field.data"].startswith(b"omitted: 100000 bytes")


async def test_acknowledging_an_entry_clears_its_recorded_error(bus):
    await fill(bus, 2)
    c = Consumer(bus, bus.keys.prompts, GROUP_RAAS, "c")
    for entry in await c.read(2, block_ms=10):
        await c.release(entry, "ValueError: once")
    a, b = await c.read(2, block_ms=10)
    assert await bus.redis.hlen(bus.keys.errors) == 2
    await c.complete([(a, [])])
    await bus.ack(bus.keys.prompts, GROUP_RAAS, [b.id])  # e.g. a trainer's checkpointed batch
    assert await bus.redis.hlen(bus.keys.errors) == 0
    assert (await bus.redis.xpending(bus.keys.prompts, GROUP_RAAS))["pending"] == 0


async def test_trim_forgets_consumers_of_past_processes_that_hold_nothing(bus, monkeypatch):
    await fill(bus, 2)
    gone = Consumer(bus, bus.keys.prompts, GROUP_RAAS, "raas-host-1-a1b2")
    holder = Consumer(bus, bus.keys.prompts, GROUP_RAAS, "raas-host-2-c3d4")
    [done] = await gone.read(1, block_ms=10)
    await gone.complete([(done, [])])
    await holder.read(1, block_ms=10)
    monkeypatch.setattr("astraflow.streams.trim.CONSUMER_FORGET_MS", 50)
    await asyncio.sleep(0.1)
    await trim(bus, bus.keys.prompts)
    consumers = await bus.redis.xinfo_consumers(bus.keys.prompts, GROUP_RAAS)
    assert [c["name"] for c in consumers] == [b"raas-host-2-c3d4"]  # still holds an entry

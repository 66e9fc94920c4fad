"""What a run costs its Redis, as `astraflow inspect` shows it: memory by key family (this run's keys
only), and the eviction policy, flagged when Redis may evict; a user without CONFIG gets 'unchecked'."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis
from structlog.testing import capture_logs

from astraflow.ops.inspect import report
from astraflow.streams import Out
from astraflow.streams.memory import UNCHECKED, eviction_policy, memory_by_family, warn_if_evicting

pytestmark = pytest.mark.integration


async def test_memory_by_family_counts_this_runs_keys_only(bus):
    k = bus.keys
    await bus.publish_many([Out(k.prompts, {"kind": "prompt", "data": b"x" * 1000}) for _ in range(5)])
    for i in range(3):
        await bus.redis.hset(k.trace(f"e0r{i}"), mapping={"row": i})
    await bus.redis.hset(k.state, "cursor", 3)
    await bus.redis.set("af:{elsewhere}:state", "not ours")
    families = await memory_by_family(bus)
    assert families["trace:*"][0] == 3
    assert families["state"][0] == 1
    assert families["batches:*"][0] == 1  # batches:policy, made by the bootstrap
    assert families["dedup:*"][0] == 5
    assert families["prompts"][1] > 5000  # five entries of 1 KB
    assert sum(n for n, _ in families.values()) == await _count(bus.redis, k.prefix + "*")
    text = await report(bus)
    assert "trace:*" in text and "maxmemory-policy: noeviction" in text and "may evict" not in text


async def test_an_evicting_policy_is_flagged_and_a_refused_check_says_so(bus, redis_url):
    await bus.redis.config_set("maxmemory-policy", "allkeys-lru")
    try:
        assert (await eviction_policy(bus))[0] == "allkeys-lru"
        with capture_logs() as logs:
            await warn_if_evicting(bus)
        assert [e["policy"] for e in logs if e["event"] == "redis_may_evict"] == ["allkeys-lru"]
        assert "may evict" in await report(bus)
    finally:
        await bus.redis.config_set("maxmemory-policy", "noeviction")
    await bus.redis.execute_command("ACL", "SETUSER", "noconfig", "on", ">pw", "~*", "+@all", "-config")
    try:
        url = redis_url.split("@")[1]
        client = aioredis.Redis.from_url(f"redis://{url}", username="noconfig", password="pw", protocol=2)
        original, bus.redis = bus.redis, client
        try:
            assert (await eviction_policy(bus))[0] == UNCHECKED
            with capture_logs() as logs:
                await warn_if_evicting(bus)
            assert [e["event"] for e in logs] == ["redis_eviction_unchecked"]
        finally:
            bus.redis = original
            await client.aclose()
    finally:
        await bus.redis.execute_command("ACL", "DELUSER", "noconfig")


async def _count(client, pattern: str) -> int:
    return len([k async for k in client.scan_iter(match=pattern)])

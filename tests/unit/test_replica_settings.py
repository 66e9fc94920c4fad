"""Replica and Sentinel settings: a bad sentinel address is refused with the field's name; reads off a lagging
replica, one that is down, and none at all."""

import fakeredis
import fakeredis.aioredis
import pytest

from astraflow.errors import ConfigError
from astraflow.settings_load import load_settings
from astraflow.streams import Bus, Keys
from astraflow.streams.replica import ReplicaReads
from astraflow.streams.settings import StreamsSettings


def test_a_sentinel_without_a_port_is_refused():
    with pytest.raises(ConfigError, match=r"redis.sentinels: .*'nohost': expected host:port"):
        load_settings(None, ['redis.sentinels=["nohost"]'])
    s = load_settings(None, ['redis.sentinels=["10.0.0.2:26379"]', "redis.min_replicas_ack=1"])
    assert s.redis.sentinels == ["10.0.0.2:26379"] and s.redis.min_replicas_ack == 1


async def test_reads_fall_back_to_the_primary_and_return_to_the_replica():
    primary_server = fakeredis.FakeServer(version=(7, 0))
    replica_server = fakeredis.FakeServer(version=(7, 0))
    primary = fakeredis.aioredis.FakeRedis(server=primary_server)
    replica = fakeredis.aioredis.FakeRedis(server=replica_server)
    bus = Bus(Keys("u"), StreamsSettings(), primary, primary, reader=ReplicaReads(replica, replica))
    await primary.hset("m1", "v", "1")
    await primary.hset("m0", "v", "0")
    await replica.hset("m0", "v", "0")  # the replica lags: it has m0, not m1

    def manifest(key):
        return bus.read_only(lambda c: c.hgetall(key), fresh=bool)

    assert await manifest("m0") == {b"v": b"0"} and bus.reader.stats == {"replica": 1}
    assert await manifest("m1") == {b"v": b"1"} and bus.reader.stats["behind"] == 1
    replica_server.connected = False  # down: the primary answers, and the replica is left alone a while
    assert await manifest("m0") == {b"v": b"0"} and await manifest("m0") == {b"v": b"0"}
    assert bus.reader.stats["fallback"] == 2 and bus.reader.stats["replica"] == 1
    replica_server.connected = True
    bus.reader._down_until = 0.0  # (REPLICA_RETRY_S passed)
    assert await manifest("m0") == {b"v": b"0"} and bus.reader.stats["replica"] == 2


async def test_without_a_replica_reads_go_to_the_primary():
    r = fakeredis.aioredis.FakeRedis(version=(7, 0))
    bus = Bus(Keys("u"), StreamsSettings(), r, r)
    await r.hset("k", "f", "v")
    assert await bus.read_only(lambda c: c.hgetall("k"), fresh=bool) == {b"f": b"v"}
    assert not bus.reader.enabled and sum(bus.reader.stats.values()) == 0

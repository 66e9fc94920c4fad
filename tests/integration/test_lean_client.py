"""A bus client's commands take a pooled connection straight from the pool (`streams.lean.LeanRedis`): what
they skip must not change what a caller sees when a command fails, is cancelled or times out."""

from __future__ import annotations

import asyncio

import pytest
from redis.exceptions import ResponseError, TimeoutError

from astraflow.streams.connection import make_client
from astraflow.streams.settings import RedisSettings

pytestmark = pytest.mark.integration


@pytest.fixture
async def client(redis_url):
    c = make_client(redis_url, RedisSettings(socket_timeout_s=0.5))
    await c.set("k", "v")  # (its first connection: made by redis-py's own path)
    yield c
    await c.aclose()


def count_checkouts(client) -> list[int]:
    checkouts, get = [], client.connection_pool.get_connection

    async def counted(*args, **kwargs):
        checkouts.append(1)
        return await get(*args, **kwargs)

    client.connection_pool.get_connection = counted
    return checkouts


async def connection_ids(client) -> set[int]:
    return {int(c["id"]) for c in await client.client_list() if c["cmd"] in ("client|list", "client")}


async def test_commands_reuse_the_idle_connection_without_the_pools_checkout(client):
    checkouts = count_checkouts(client)
    first = await connection_ids(client)
    for _ in range(20):
        assert await client.get("k") == b"v"
    assert checkouts == []
    assert await connection_ids(client) == first  # one connection throughout
    assert len(client.connection_pool._in_use_connections) == 0


async def test_an_error_reply_keeps_the_connection_and_the_next_command_is_answered(client):
    await client.lpush("list", "x")
    first = await connection_ids(client)
    with pytest.raises(ResponseError, match="WRONGTYPE"):
        await client.get("list")
    assert await client.get("k") == b"v"
    assert await connection_ids(client) == first


async def test_a_connection_the_server_closed_is_replaced_before_the_next_command(client, redis_url):
    """As redis-py's own path does (a restarted Redis closes every connection): the command after is
    answered on a new connection, not failed on the closed one."""
    [old] = await connection_ids(client)
    other = make_client(redis_url, RedisSettings())
    await other.client_kill_filter(_id=old)
    await other.aclose()
    await asyncio.sleep(0.1)  # (the event loop sees the end of its stream)
    assert await client.get("k") == b"v"
    assert old not in await connection_ids(client)


async def test_a_cancelled_read_drops_its_connection_so_no_later_command_gets_its_reply(client, redis_url):
    reading = asyncio.create_task(client.xread({"s": "$"}, block=300))
    await asyncio.sleep(0.1)
    reading.cancel()
    await asyncio.gather(reading, return_exceptions=True)
    other = make_client(redis_url, RedisSettings())
    await other.xadd("s", {"f": "late"})  # what the abandoned read would have been answered
    await other.aclose()
    for _ in range(3):
        assert await client.get("k") == b"v"


async def test_a_reply_that_never_comes_times_out_and_the_next_command_is_answered(client):
    with pytest.raises(TimeoutError):
        await client.blpop(["empty"], timeout=2)  # longer than the socket timeout
    assert await client.get("k") == b"v"

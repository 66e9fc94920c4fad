"""Which Redis errors are waited out, and how long a call waits."""

import math

import pytest
from redis.exceptions import ConnectionError, OutOfMemoryError, ResponseError

from astraflow.errors import BusConnectionError
from astraflow.streams.connection import is_transient, reconnecting


@pytest.mark.parametrize(
    "error",
    [
        OutOfMemoryError("command not allowed when used memory > 'maxmemory'.", status_code="OOM"),
        ResponseError("BUSY Redis is busy running a script."),
        ResponseError("MISCONF Redis is configured to save RDB snapshots, but it's currently unable"),
        # Redis 6.2 reports a script's refused write inside an ERR reply
        ResponseError("Error running script (call to f_e810): @user_script:1: @user_script: 1: -OOM command"),
        ConnectionError("Connection refused"),
    ],
)
def test_redis_refusing_for_now_is_transient(error):
    assert is_transient(error)


@pytest.mark.parametrize(
    "error",
    [
        ResponseError("BUSYGROUP Consumer Group name already exists"),
        ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"),
        ResponseError("Error running script (call to f_e810): @user_script:1: user_script:1: bad argument"),
        ValueError("bug"),
    ],
)
def test_a_wrong_call_is_not_transient(error):
    assert not is_transient(error)


async def test_oom_replies_are_retried_until_redis_takes_the_write():
    replies = [OutOfMemoryError("command not allowed", status_code="OOM")] * 3 + ["ok"]
    lost = []

    async def call():
        reply = replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply

    assert await reconnecting(call, math.inf, on_lost=lambda: lost.append(True)) == "ok"
    assert lost == [True] * 3


async def test_a_one_shot_budget_still_gives_up():
    async def call():
        raise ConnectionError("Connection refused")

    with pytest.raises(BusConnectionError):
        await reconnecting(call, 0)

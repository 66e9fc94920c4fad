"""Which Redis errors are waited out, and how long a call waits."""

import asyncio
import math

import pytest
from redis.exceptions import (
    AuthenticationError,
    ConnectionError,
    NoPermissionError,
    OutOfMemoryError,
    ResponseError,
)

from astraflow.errors import BusConnectionError
from astraflow.streams.connection import REFUSED_AFTER, RequestRefused, is_transient, reconnecting
from astraflow.streams.replica import connect_clients
from astraflow.streams.settings import RedisSettings


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
        # refused credentials and ACL: redis-py makes the first a ConnectionError, yet no wait helps
        AuthenticationError("invalid username-password pair or user is disabled."),
        AuthenticationError("Authentication required."),
        NoPermissionError("this user has no permissions to run the 'xadd' command"),
    ],
)
def test_a_wrong_call_is_not_transient(error):
    assert not is_transient(error)


async def test_a_refused_password_is_raised_at_once_not_waited_out():
    calls = []

    async def call():
        calls.append(1)
        raise AuthenticationError("invalid username-password pair or user is disabled.")

    with pytest.raises(AuthenticationError):
        await reconnecting(call, math.inf)  # (a worker's budget: an outage would be waited out forever)
    assert len(calls) == 1


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


async def test_a_cancellation_swallowed_by_a_library_stops_the_next_call():
    """Python 3.11's `wait_for` returns its result when a cancel arrives just as it finished (redis-py
    sends every command through one): the task goes on, cancelled. Its next bus call must not run."""
    calls = 0

    async def call():
        nonlocal calls
        calls += 1

    async def worker():
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            pass  # what the race in wait_for amounts to
        for _ in range(100):  # a worker's loop: every pass makes a bus call
            await reconnecting(call, math.inf)

    task = asyncio.create_task(worker())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)
    assert calls == 0


RESET = ConnectionError("Error 104 while writing to socket. Connection reset by peer.")


async def test_a_request_redis_keeps_closing_while_it_answers_a_ping_is_refused():
    """Redis 6.2 closes the connection on a request of more than 1,048,576 arguments: sending it again
    forever (at high CPU, with nothing logged) is what a user saw; it must fail with the reason."""
    calls, pings = [], []

    async def call():
        calls.append(True)
        raise RESET

    async def ping():
        pings.append(True)

    with pytest.raises(RequestRefused, match="closed the connection on this request 3 times"):
        await reconnecting(call, math.inf, probe=ping)
    assert len(calls) == len(pings) == REFUSED_AFTER


async def test_an_outage_is_waited_out_however_often_the_connection_breaks():
    """While Redis is away the probe fails too: every failed attempt is an outage, not a refusal; a probe
    that gets through now and then (Redis flapping) does not add up to one either."""
    attempts = [RESET] * 8 + ["ok"]
    probes = [True, True, False, True, True, False, True, False]

    async def call():
        reply = attempts.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply

    async def ping():
        if not probes.pop(0):
            raise ConnectionError("Connection refused")

    assert await reconnecting(call, math.inf, probe=ping) == "ok"


def test_commands_are_packed_in_c_to_the_same_bytes():
    """Every bus client packs commands with hiredis: the bytes redis-py's own packer would send."""
    from redis.asyncio.connection import Connection

    from astraflow.streams.connection import make_client
    from astraflow.streams.lean import lean_connections
    from astraflow.streams.settings import RedisSettings

    client = make_client("redis://127.0.0.1:1", RedisSettings())
    ours, theirs = client.connection_pool.make_connection(), Connection()
    args = ("CONFIG GET", "maxmemory", b"\x00\xff", 7, 1.5, "é", bytearray(b"ab"), memoryview(b"cd"))
    packed = ours.pack_command(*args)
    assert len(packed) == 1 and type(ours).pack_command is not Connection.pack_command  # hiredis: one piece
    assert b"".join(packed) == b"".join(theirs.pack_command(*args))
    packing = client.connection_pool.connection_class
    assert lean_connections(client).connection_pool.connection_class is packing  # once is enough


async def _silent_on_get(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A server that answers +OK to every command but GET, which it never answers (a Redis gone quiet)."""
    while True:
        head = await reader.readline()
        if not head:
            return
        args = []
        for _ in range(int(head[1:])):
            size = int((await reader.readline())[1:])
            args.append((await reader.readexactly(size + 2))[:-2])
        if args[0].upper() != b"GET":
            writer.write(b"+OK\r\n")
            await writer.drain()


async def test_a_small_command_is_sent_without_a_task_of_its_own_and_its_reply_still_times_out(monkeypatch):
    """redis-py sends under `asyncio.wait_for` while a socket timeout is set: on Python 3.11 a task per
    command. A bus client sends a small command without it (nothing to wait for), a large one with it, and
    a reply that never comes still times out."""
    import time

    from redis.exceptions import TimeoutError

    from astraflow.streams.connection import make_client
    from astraflow.streams.lean import SMALL_SEND
    from astraflow.streams.settings import RedisSettings

    server = await asyncio.start_server(_silent_on_get, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    sends, wait_for = [], asyncio.wait_for

    def counted(aw, timeout):
        sends.append(timeout)
        return wait_for(aw, timeout)

    monkeypatch.setattr(asyncio, "wait_for", counted)
    client = make_client(f"redis://127.0.0.1:{port}", RedisSettings(socket_timeout_s=0.3))
    try:
        await client.set("k", "v")  # connects first (under the timeouts)
        before = len(sends)
        await client.set("k", "v")
        assert len(sends) == before
        await client.set("k", b"x" * SMALL_SEND)
        assert sends[before:] == [0.3]
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            await client.get("k")
        assert time.monotonic() - start < 3
        await client.set("k", "v")  # a new connection: the timed-out one was dropped
    finally:
        await client.aclose()
        server.close()


def test_clients_are_made_without_a_python_warning(recwarn):
    """redis-py 8 warns "A synchronous redis.retry.Retry was passed to an asyncio client" for every client
    made with the sync Retry: on the first screen of every command (issue 41)."""
    connect_clients("redis://127.0.0.1:1", RedisSettings(), read_timeout_s=5)
    assert [str(w.message) for w in recwarn] == []

"""Redis clients made lean on the bus's hot path: what redis-py does per command that a bus client does
not need (every dataflow step is a command or two, a hundred a second), done without."""

from __future__ import annotations

import functools

import redis.asyncio as aioredis
from redis.exceptions import DataError, ResponseError

SMALL_SEND = 16 << 10
"""Bytes a command may have to be sent without a timeout of its own: far below the 64 KiB at which an
asyncio transport makes a writer wait (see `lean_connections`)."""


def lean_connections(client: aioredis.Redis) -> aioredis.Redis:
    """`client`, its connections lean: packing commands with hiredis (the same bytes as redis-py's Python
    packer in a seventh of the time: a hand-off of 100 entries carries over a thousand arguments), and
    sending a small command without redis-py's `asyncio.wait_for`, which on Python 3.11 wraps every send
    in a task of its own (about a quarter of a GET's CPU through redis-py)."""
    pool = client.connection_pool
    if not getattr(pool.connection_class, "lean", False):
        pool.connection_class = _lean_connection(pool.connection_class)
    return client


@functools.cache
def _lean_connection(connection_class: type) -> type:
    import hiredis

    class Lean(connection_class):
        lean = True

        def pack_command(self, *args) -> list[bytes]:
            if isinstance(args[0], str):  # 'CONFIG GET' and the like are sent as separate arguments
                args = (*args[0].encode().split(), *args[1:])
            elif b" " in args[0]:
                args = (*args[0].split(), *args[1:])
            try:
                return [hiredis.pack_command(args)]
            except TypeError:  # hiredis takes bytes, str, int and float: a bytearray or memoryview once more
                args = tuple(bytes(a) if isinstance(a, bytearray | memoryview) else a for a in args)
            try:
                return [hiredis.pack_command(args)]
            except TypeError as e:
                raise DataError(str(e)) from None

        async def send_packed_command(self, command, check_health: bool = True) -> None:
            # A connected socket takes a small command into its transport's buffer at once (the buffer is
            # empty between commands: each waits for its reply, which keeps its timeout), so the send has
            # nothing to wait for and no timeout to keep: it runs with none, and its errors as redis-py's.
            timeout = self.socket_timeout
            if not timeout or not self.is_connected or self.health_check_interval or not _small(command):
                return await super().send_packed_command(command, check_health)
            self.socket_timeout = None  # (this connection serves this command alone)
            try:
                return await super().send_packed_command(command, check_health)
            finally:
                self.socket_timeout = timeout

    Lean.__name__ = f"Lean{connection_class.__name__}"
    return Lean


def _small(command) -> bool:
    """Whether a packed command (bytes, or a list of them) is under SMALL_SEND bytes."""
    if isinstance(command, bytes | str):
        return len(command) < SMALL_SEND
    return sum(map(len, command)) < SMALL_SEND


class LeanRedis(aioredis.Redis):
    """A client whose commands take a connection of a plain pool straight from its list: no pool lock
    (nothing else runs between the take and the send), no `can_read` read of a connection that was
    read to its end (a look at its stream says whether the server closed it meanwhile), no retry wrapper
    (bus clients never retry: `reconnecting` does) and no observability hooks - a third of a GET's CPU
    through redis-py. A connection that fails is dropped as redis-py drops it. A single-connection
    client, a blocking or Sentinel pool, and a pool with no open connection at hand take redis-py's own
    path (which reconnects one the server closed, a restart, before sending)."""

    async def execute_command(self, *args, **options):
        pool = self.connection_pool
        idle = pool._available_connections
        if self.single_connection_client or type(pool) is not aioredis.ConnectionPool or not idle:
            return await super().execute_command(*args, **options)
        conn = idle.pop()
        if not _open(conn):
            idle.append(conn)
            return await super().execute_command(*args, **options)
        pool._in_use_connections.add(conn)
        try:
            return await self._send_command_parse_response(conn, args[0], *args, **options)
        except ResponseError:
            raise  # an error reply, read whole: the connection is as good as before
        except BaseException:
            await conn.disconnect(nowait=True)  # (as redis-py: a reply may still be on its way)
            raise
        finally:
            pool._in_use_connections.discard(conn)
            idle.append(conn)


def _open(conn) -> bool:
    """Whether `conn` is connected and its server has neither closed nor reset it since (the event loop
    has fed its stream the end or the error: a restarted Redis's old connections)."""
    reader = getattr(conn, "_reader", None)
    return conn.is_connected and reader is not None and not reader.at_eof() and reader.exception() is None

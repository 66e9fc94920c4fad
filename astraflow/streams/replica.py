"""Where a bus's commands go: the primary (or the one Sentinel names), read-only traffic off a replica, and
writes that return once enough replicas have them (`replicated`).

A RaaS in a far region reads notices, weight manifests and peer lists off its region's replica
(`redis.replica_url`) and sends everything else to the primary. A replica may lag: a read whose answer is
missing there (a manifest not replicated yet) is asked of the primary. A replica that is down or refusing
is left for `REPLICA_RETRY_S` and its reads go to the primary meanwhile. With `redis.sentinels`, the
clients are Sentinel's: the primary is whichever server Sentinel names now, so every worker follows a
failover (the failover window - connections refused, READONLY - is a transient outage to `reconnecting`).
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from astraflow.streams.connection import (
    client_kwargs,
    credentials,
    is_transient,
    make_client,
    queue_script,
    raise_if_cancelled,
    with_script,
)
from astraflow.streams.functions import Script
from astraflow.streams.lean import lean_connections
from astraflow.streams.settings import RedisSettings

T = TypeVar("T")
REPLICA_RETRY_S = 5.0
"""After a replica failed, its reads go to the primary for this long before the replica is tried again."""


def connect_clients(
    url: str, settings: RedisSettings, *, read_timeout_s: float | None = None
) -> tuple[aioredis.Redis, aioredis.Redis | None]:
    """(primary, replica or None) clients; `read_timeout_s` for connections that block."""
    replica = None
    if settings.replica_url:
        replica = make_client(settings.replica_url, settings, read_timeout_s=read_timeout_s)
    if not settings.sentinels:
        return make_client(url, settings, read_timeout_s=read_timeout_s), replica
    from redis.asyncio.sentinel import Sentinel

    kwargs = {**client_kwargs(settings, read_timeout_s), **credentials(settings)}
    addresses = [(h, int(p)) for h, _, p in (s.rpartition(":") for s in settings.sentinels)]
    sentinel = Sentinel(addresses, sentinel_kwargs=client_kwargs(settings, None), **kwargs)
    primary = sentinel.master_for(settings.master_name, redis_class=aioredis.Redis)
    replica = replica or sentinel.slave_for(settings.master_name, redis_class=aioredis.Redis)
    return lean_connections(primary), lean_connections(replica)


class ReplicaReads:
    """Run read-only commands on the replica when there is one and it answers, else on the primary.

    `stats`: `replica` reads answered by the replica, `behind` asked again of the primary because the
    replica's answer was missing (lag), `fallback` sent to the primary because the replica was down or
    refusing (or left alone since it was).
    """

    def __init__(self, replica: aioredis.Redis | None, blocking: aioredis.Redis | None) -> None:
        self.replica, self.blocking = replica, blocking
        self.stats: Counter[str] = Counter()
        self._down_until = 0.0

    @property
    def enabled(self) -> bool:
        return self.replica is not None

    def client(self, blocking: bool) -> aioredis.Redis | None:
        """The replica's client to try now (None: go to the primary)."""
        if self.replica is None or time.monotonic() < self._down_until:
            return None
        return self.blocking if blocking else self.replica

    async def read(
        self,
        command: Callable[[aioredis.Redis], Awaitable[T]],
        on_primary: Callable[[], Awaitable[T]],
        *,
        blocking: bool = False,
        fresh: Callable[[T], bool] = lambda _: True,
    ) -> T:
        """`command(replica)` when the replica answers with a `fresh` reply, else `on_primary()`."""
        client = self.client(blocking)
        if client is not None:
            try:
                reply = await command(client)
            except Exception as e:
                if not is_transient(e):
                    raise
                raise_if_cancelled()
                self._down_until = time.monotonic() + REPLICA_RETRY_S
                self.stats["fallback"] += 1
            else:
                if fresh(reply):
                    self.stats["replica"] += 1
                    return reply
                self.stats["behind"] += 1
        elif self.replica is not None:
            self.stats["fallback"] += 1
        return await on_primary()

    async def close(self) -> None:
        for c in (self.replica, self.blocking):
            if c is not None:
                await c.aclose()


async def replicated(
    client: aioredis.Redis, script: Script, keys: list, args: list, n: int, timeout_ms: int, marker: str
):
    """Run `script`, then `WAIT` until `n` replicas have it (on the same connection, which is what WAIT
    waits for); fewer in `timeout_ms` raise NOREPLICAS, a transient error, so the caller's `reconnecting`
    tries again. The script must be idempotent: the retry writes nothing twice, and on a promoted replica
    that lacks the first attempt it does the work anew. The SET of key `marker` gives a retry whose script
    writes nothing something of its own to wait for, ordered after whatever the first attempt wrote."""

    def fill(pipe) -> None:
        queue_script(pipe, script, keys, args)
        pipe.set(marker, uuid.uuid4().hex, px=timeout_ms)
        pipe.execute_command("WAIT", n, timeout_ms)

    reply, _, acked = await with_script(client, script, fill, transaction=False)
    if int(acked) < n:
        raise ResponseError(f"NOREPLICAS {acked} of {n} replicas acknowledged in {timeout_ms} ms")
    return reply


async def replica_lag(client: aioredis.Redis) -> list[tuple[str, int]]:
    """Each replica the primary knows (`INFO replication`): (address, bytes behind the primary)."""
    info = await client.info("replication")
    offset = int(info.get("master_repl_offset", 0))
    return [
        (f"{v['ip']}:{v['port']}", offset - int(v["offset"]))
        for k, v in sorted(info.items())
        if k.startswith("slave") and isinstance(v, dict)
    ]

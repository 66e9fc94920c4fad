"""Redis clients with reconnect-and-backoff, and the Lua scripts registered once per client."""

from __future__ import annotations

import math
from importlib import resources

import redis.asyncio as aioredis
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError, TimeoutError
from redis.retry import Retry

from astraflow.streams.settings import RedisSettings

BACKOFF_CAP_S = 0.5
SCRIPT_NAMES = ("handoff", "renew", "release", "reclaim", "trim")


def make_client(url: str, settings: RedisSettings, *, read_timeout_s: float | None = None,
                retry: bool = True) -> aioredis.Redis:
    """A client whose commands reconnect with jittered backoff for up to `reconnect_max_s`.

    RESP2 everywhere: Redis 6.2, 7.x and fakeredis then give the same reply shapes. Writes may be retried
    after a lost reply, so every write the bus makes is idempotent (dedup keys, owner checks).
    `read_timeout_s` is for connections that block (XREADGROUP BLOCK): it must exceed the block time.
    """
    retries = math.ceil(settings.reconnect_max_s / BACKOFF_CAP_S) if retry else 0
    return aioredis.Redis.from_url(
        url,
        password=settings.password.get_secret_value() if settings.password else None,
        protocol=2,
        socket_timeout=read_timeout_s or settings.socket_timeout_s,
        socket_connect_timeout=settings.socket_timeout_s,
        retry=Retry(ExponentialWithJitterBackoff(base=0.02, cap=BACKOFF_CAP_S), retries),
        retry_on_error=[ConnectionError, TimeoutError],
        decode_responses=False,
    )


def register_scripts(client: aioredis.Redis) -> dict[str, object]:
    """Load every `lua/*.lua` once; a script lost to a Redis restart is reloaded on NOSCRIPT."""
    lua = resources.files("astraflow.streams") / "lua"
    return {name: client.register_script((lua / f"{name}.lua").read_text()) for name in SCRIPT_NAMES}

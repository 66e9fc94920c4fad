"""What a run costs its Redis: memory by key family, and whether the server may evict (lose) entries."""

from __future__ import annotations

import structlog
from redis.exceptions import ResponseError

from astraflow.streams.bus import Bus

log = structlog.get_logger(__name__)

SCAN_COUNT = 1000
UNCHECKED = "unchecked"
"""`eviction_policy`'s answer when the server refused CONFIG GET (an ACL user without it)."""


def family(short_key: str) -> str:
    """`batches:policy` -> `batches:*`, `trace:e0r1` -> `trace:*`, `prompts` -> `prompts`."""
    head, sep, _ = short_key.partition(":")
    return f"{head}:*" if sep else head


async def memory_by_family(bus: Bus) -> dict[str, tuple[int, int]]:
    """Family -> (keys, bytes by MEMORY USAGE) over a SCAN of the run's keys, largest first; the weight
    secret (a few bytes, and not the observer's to read) is left out."""
    totals: dict[str, list[int]] = {}
    batch: list[bytes] = []

    async def flush() -> None:
        async with bus.redis.pipeline(transaction=False) as pipe:
            for key in batch:
                pipe.memory_usage(key)
            sizes = await pipe.execute()
        for key, size in zip(batch, sizes, strict=True):
            if size is not None:  # (it expired meanwhile)
                t = totals.setdefault(family(bus.keys.short(key.decode())), [0, 0])
                t[0], t[1] = t[0] + 1, t[1] + int(size)
        batch.clear()

    secret = bus.keys.weights_secret.encode()
    async for key in bus.redis.scan_iter(match=bus.keys.prefix + "*", count=SCAN_COUNT):
        if key == secret:
            continue
        batch.append(key)
        if len(batch) >= SCAN_COUNT:
            await flush()
    if batch:
        await flush()
    return {f: (n, size) for f, (n, size) in sorted(totals.items(), key=lambda kv: -kv[1][1])}


def render_memory(families: dict[str, tuple[int, int]]) -> str:
    rows = [("family", "keys", "memory")] + [(f, str(n), _size(b)) for f, (n, b) in families.items()]
    total = sum(b for _, b in families.values())
    rows.append(("total", str(sum(n for n, _ in families.values())), _size(total)))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


async def eviction_policy(bus: Bus) -> tuple[str, int]:
    """(maxmemory-policy, maxmemory bytes); (UNCHECKED, 0) when the server refuses CONFIG GET."""
    try:
        raw = await bus.call(lambda: bus.redis.config_get("maxmemory*"))
    except ResponseError:  # NOPERM for an ACL user without CONFIG (the usual case on a shared Redis)
        return UNCHECKED, 0
    config = {_text(k): _text(v) for k, v in raw.items()}
    return config.get("maxmemory-policy", ""), int(config.get("maxmemory", "0"))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def warn_if_evicting(bus: Bus) -> None:
    """Log a warning when Redis may evict keys: an evicted stream entry or state key is lost silently."""
    policy, maxmemory = await eviction_policy(bus)
    if policy == UNCHECKED:
        log.info("redis_eviction_unchecked", reason="CONFIG GET refused; ask the Redis admin: noeviction?")
    elif policy != "noeviction":
        log.warning(
            "redis_may_evict",
            policy=policy,
            maxmemory=maxmemory,
            fix="CONFIG SET maxmemory-policy noeviction (evicted entries are lost without an error)",
        )

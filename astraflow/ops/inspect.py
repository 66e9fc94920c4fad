"""`astraflow inspect`: every stream of a run (length, groups, consumers, pending, lag), the dead letters,
the run's memory by key family, the eviction policy and the replicas; and the rendering of it."""

from __future__ import annotations

import asyncio

from redis.exceptions import ResponseError

from astraflow.ops.context import settings_from, with_bus
from astraflow.streams.bus import Bus
from astraflow.streams.memory import UNCHECKED, eviction_policy, memory_by_family, render_memory
from astraflow.streams.replica import replica_lag
from astraflow.streams.views import LAG_SCAN_LIMIT, StreamView, inspect_run


def cmd_inspect(args) -> int:
    return asyncio.run(with_bus(settings_from(args), _print_report))


async def _print_report(bus: Bus) -> int:
    print(await report(bus))
    return 0


def render(views: list[StreamView], dead_count: int) -> str:
    rows = [("stream", "length", "group", "consumers", "pending", "oldest pending", "lag")]
    for v in views:
        if not v.groups:
            rows.append((v.key, str(v.length), "-", "-", "-", "-", "-"))
        for g in v.groups:
            idle = g.oldest_pending_idle_ms
            oldest = "-" if idle is None else f"{idle / 1000:.1f}s idle"
            lag = f">{LAG_SCAN_LIMIT}" if g.lag is None else str(g.lag)
            rows.append((v.key, str(v.length), g.name, str(g.consumers), str(g.pending), oldest, lag))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.append(f"dead letters: {dead_count}")
    for v in views:
        for g in v.groups:
            if not g.known:
                lines.append(
                    f"WARNING: group {g.name!r} on {v.key} is not one of the run's: trimming ignores it"
                    " (it may miss entries); remove it with `astraflow clear --run RUN --unknown-groups`"
                )
    return "\n".join(lines)


async def report(bus: Bus) -> str:
    """`astraflow inspect`: the streams, the dead letters, the run's memory by key family, the eviction
    policy."""
    streams = render(await inspect_run(bus), await bus.redis.xlen(bus.keys.dead))
    policy, maxmemory = await eviction_policy(bus)
    limit = f", maxmemory {maxmemory} B" if maxmemory else ""
    evicting = "" if policy in ("noeviction", UNCHECKED) else "  (may evict: entries lost silently)"
    memory = render_memory(await memory_by_family(bus))
    replicas = await render_replicas(bus)
    return f"{streams}\n\n{memory}\n\nmaxmemory-policy: {policy}{limit}{evicting}\n{replicas}"


async def render_replicas(bus: Bus) -> str:
    """Each replica of the primary and how far behind it is (bytes of the replication stream)."""
    try:
        lags = await bus.call(lambda: replica_lag(bus.redis))
    except ResponseError:  # NOPERM: a user without INFO
        return "replicas: unchecked (INFO refused)"
    if not lags:
        return "replicas: none"
    return "replicas: " + ", ".join(f"{address} lag {lag} B" for address, lag in lags)

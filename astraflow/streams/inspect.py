"""The operator's view of a run's streams: length, groups, consumers, pending, oldest pending, lag, dead."""

from __future__ import annotations

from dataclasses import dataclass, field

from redis.exceptions import ResponseError

from astraflow.streams.bus import Bus
from astraflow.streams.memory import UNCHECKED, eviction_policy, memory_by_family, render_memory
from astraflow.streams.replica import replica_lag

LAG_SCAN_LIMIT = 10_000


@dataclass
class GroupView:
    name: str
    consumers: int
    pending: int
    oldest_pending_idle_ms: int | None
    lag: int | None
    """Entries not yet delivered to the group; None when more than LAG_SCAN_LIMIT (Redis 6.2 count)."""
    known: bool = True
    """Whether it is the run's group of its stream (`Keys.group_of`); an unknown one holds nothing back."""


@dataclass
class StreamView:
    key: str
    length: int
    groups: list[GroupView] = field(default_factory=list)


async def inspect_run(bus: Bus) -> list[StreamView]:
    """Every stream of the run, with its groups (sorted by name)."""
    keys = [k.decode() async for k in bus.redis.scan_iter(match=bus.keys.prefix + "*", _type="stream")]
    return [await _stream_view(bus, key) for key in sorted(keys)]


async def _stream_view(bus: Bus, key: str) -> StreamView:
    r = bus.redis
    view = StreamView(bus.keys.short(key), await r.xlen(key))
    for g in await r.xinfo_groups(key):
        name = g["name"].decode()
        oldest = None
        summary = await r.xpending(key, name)
        if summary["pending"]:  # (it may be acknowledged meanwhile)
            first = await r.xpending_range(key, name, summary["min"], summary["min"], 1)
            oldest = first[0]["time_since_delivered"] if first else None
        lag = g.get("lag")
        if lag is None:  # Redis 6.2 does not report it: count what lies after the last delivered id.
            after = await r.xrange(key, b"(" + g["last-delivered-id"], "+", count=LAG_SCAN_LIMIT + 1)
            lag = len(after) if len(after) <= LAG_SCAN_LIMIT else None
        known = bus.keys.group_of(key) == name
        view.groups.append(GroupView(name, g["consumers"], summary["pending"], oldest, lag, known))
    return view


async def unknown_groups(bus: Bus) -> list[tuple[str, str]]:
    """(stream key, group) of every consumer group on a stream of the run that is not the run's."""
    keys = [k.decode() async for k in bus.redis.scan_iter(match=bus.keys.prefix + "*", _type="stream")]
    found = []
    for key in sorted(keys):
        for g in await bus.call(lambda k=key: bus.redis.xinfo_groups(k)):
            if bus.keys.group_of(key) != g["name"].decode():
                found.append((key, g["name"].decode()))
    return found


async def remove_unknown_groups(bus: Bus) -> list[tuple[str, str]]:
    """`astraflow clear --unknown-groups`: destroy every group `unknown_groups` finds; returns them."""
    found = await unknown_groups(bus)
    for key, group in found:
        await bus.call(lambda k=key, g=group: bus.redis.xgroup_destroy(k, g))
    return found


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

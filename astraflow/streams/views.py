"""The state of a run's streams as Redis reports it: length, groups, consumers, pending, oldest pending,
lag (`inspect_run`); and consumer groups on them that are not the run's (`unknown_groups`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from astraflow.streams.bus import Bus

LAG_SCAN_LIMIT = 10_000
SCAN_COUNT = 10_000
"""Keys a SCAN step of the views looks at. A run holds tens of thousands of keys (a trace per prompt
group, a dedup marker per hand-off); at Redis's default of 10 a look at the run's streams took thousands
of round trips, and was most of the launcher's CPU and a sixth of the run's Redis commands."""


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


LAST_ID = b"18446744073709551615-18446744073709551615"
"""The largest stream id: an entry of it exhausts its stream (written by someone, see docs/security.md)."""


async def inspect_run(bus: Bus) -> list[StreamView]:
    """Every stream of the run, with its groups (sorted by name)."""
    keys = await _streams(bus)
    return [await _stream_view(bus, key) for key in sorted(keys)]


async def _streams(bus: Bus) -> list[str]:
    """The keys of the run's streams."""
    scan = bus.redis.scan_iter(match=bus.keys.prefix + "*", count=SCAN_COUNT, _type="stream")
    return [k.decode() async for k in scan]


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
        if g["last-delivered-id"] == LAST_ID:  # (nothing can lie after it, and XRANGE refuses to look)
            lag = 0
        if lag is None:  # Redis 6.2 does not report it: count what lies after the last delivered id.
            after = await r.xrange(key, b"(" + g["last-delivered-id"], "+", count=LAG_SCAN_LIMIT + 1)
            lag = len(after) if len(after) <= LAG_SCAN_LIMIT else None
        known = bus.keys.group_of(key) == name
        view.groups.append(GroupView(name, g["consumers"], summary["pending"], oldest, lag, known))
    return view


async def unknown_groups(bus: Bus) -> list[tuple[str, str]]:
    """(stream key, group) of every consumer group on a stream of the run that is not the run's."""
    keys = await _streams(bus)
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

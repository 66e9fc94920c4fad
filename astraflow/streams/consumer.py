"""One consumer of one consumer group: capacity-bounded reads, leases on what it holds, reclaim."""

from __future__ import annotations

import time
from collections.abc import Sequence

from redis.exceptions import ResponseError

from astraflow.streams.bus import Bus, Entry, Out
from astraflow.streams.connection import reconnecting


class Consumer:
    """Reads `stream` as `name` in `group` and tracks the entries it holds (`in_flight`).

    On start, and after any lost connection, it first re-reads its own pending entries (id 0: work it was
    given but never acknowledged, e.g. before a restart), then new ones ('>'). Every `lease_ms / 2` a read
    also reclaims entries whose owner stopped renewing.
    """

    def __init__(self, bus: Bus, stream: str, group: str, name: str) -> None:
        self.bus, self.stream, self.group, self.name = bus, stream, group, name
        self.in_flight: dict[str, Entry] = {}
        self._cursor: str | None = "0"
        self._next_reclaim = 0.0

    async def read(self, count: int, block_ms: int | None = None) -> list[Entry]:
        """Up to `count` entries: reclaimed ones, own pending ones, then new ones (blocking `block_ms`)."""
        if count <= 0:
            return []
        block_ms = self.bus.settings.block_ms if block_ms is None else block_ms
        entries = await self._retrying(self._read, count, block_ms)
        for e in entries:
            self.in_flight[e.id] = e
        return entries

    async def _read(self, count: int, block_ms: int) -> list[Entry]:
        out: list[Entry] = []
        if time.monotonic() >= self._next_reclaim:
            self._next_reclaim = time.monotonic() + self.bus.settings.lease_ms / 2000
            out += await self.bus.reclaim(self.stream, self.group, self.name, count)
        while self._cursor is not None and len(out) < count:
            wanted = count - len(out)
            history = await self.bus.read(self.stream, self.group, self.name, self._cursor, wanted, None)
            if not history:
                self._cursor = None
                break
            self._cursor = history[-1].id
            out += [e for e in history if e.id not in self.in_flight]
        if len(out) < count:
            block = None if out else block_ms
            out += await self.bus.read(self.stream, self.group, self.name, ">", count - len(out), block)
        return out

    async def renew(self) -> list[Entry]:
        """Renew the leases of everything held; returns (and forgets) entries lost to a reclaim."""
        lost = await self._retrying(self.bus.renew, self.stream, self.group, self.name, list(self.in_flight))
        return [self.in_flight.pop(i) for i in lost if i in self.in_flight]

    async def complete(self, done: Sequence[tuple[Entry, Sequence[Out]]]) -> list[str]:
        """Publish each entry's outputs and acknowledge it, atomically; returns each item's status."""
        items = [(e.id, outs) for e, outs in done]
        replies = await self.bus.handoff(self.stream, self.group, self.name, items)
        for e, _ in done:
            self.in_flight.pop(e.id, None)
        return [status for status, _ in replies]

    async def release(self, entry: Entry, reason: str) -> None:
        """Hand an entry back for another delivery (its handler failed): dead after max_deliveries."""
        self.in_flight.pop(entry.id, None)
        await self.bus.release(self.stream, self.group, self.name, entry.id, reason)

    async def dead_letter(self, entry: Entry, reason: str) -> None:
        """Send an entry that can never succeed (undecodable, invalid) straight to `dead`."""
        self.in_flight.pop(entry.id, None)
        await self.bus.dead_letter(entry, self.group, self.name, reason)

    async def _retrying(self, fn, *args):
        """Run a read-side call through reconnects; recreate the group if Redis lost it."""
        def lost() -> None:
            # A lost XREADGROUP reply leaves entries in our pending list: read them again.
            self._cursor = "0"

        while True:
            try:
                return await reconnecting(lambda: fn(*args), self.bus.reconnect_max_s, lost)
            except ResponseError as e:
                if "NOGROUP" not in str(e):
                    raise
                await self.bus.ensure_group(self.stream, self.group)

"""One consumer of one consumer group: capacity-bounded reads, leases on what it holds, reclaim."""

from __future__ import annotations

import time
from collections.abc import Sequence

from redis.exceptions import ResponseError

from astraflow.streams.bus import Bus
from astraflow.streams.connection import BACKOFF_CAP_S, is_transient
from astraflow.streams.entries import Delivery, Out

RENEW_LAG_S = 1.5 * BACKOFF_CAP_S
"""How long after Redis is back a renewal in flight may still be backing off (the jittered cap)."""


class Consumer:
    """Reads `stream` as `name` in `group` and tracks the entries it holds (`in_flight`).

    A read first takes back this consumer's own pending entries that it does not hold (work it was given
    before a restart, or whose XREADGROUP reply was lost) - at its first read, after a failed call, and
    every `lease_ms / 2` in any case, since no other consumer ever claims them and a reply can be lost
    without a failure that this consumer sees - then, every `lease_ms / 2`, entries of other consumers
    idle past the lease, then new entries. A claim counts as a delivery when the last attempt
    ended badly (its handler failed, or its owner crashed or stopped renewing), so an entry that keeps
    killing its workers still reaches `dead` after max_deliveries; taking back an entry this process only
    lost track of (a lost reply, a hand-off that failed while Redis was away) does not count.

    After a Redis outage every pending entry looks idle for the whole downtime. So that an entry is
    reclaimed only when its owner really stopped renewing for a lease *while Redis was up*, owners renew
    at once when Redis is back (a renewal in flight gets through within RENEW_LAG_S), and this consumer
    reclaims other consumers' entries only once a lease (plus RENEW_LAG_S) has passed since any call of its
    bus last failed (a reclaim that was being retried across an outage is dropped). A live owner renews
    within a third of a lease, so only the entries of owners that are really gone are idle past the lease
    by then.
    """

    def __init__(self, bus: Bus, stream: str, group: str, name: str) -> None:
        self.bus, self.stream, self.group, self.name = bus, stream, group, name
        self.in_flight: dict[str, Delivery] = {}
        self._since_ms: int | None = None  # Redis time of the first read: deliveries before are not ours
        self._own_cursor: str | None = None
        self._rescan = True  # set from anywhere; the next read starts a new scan of own entries
        self._next_own_scan = 0.0  # (monotonic) a scan of own entries starts at the first read after it
        self._others_cursor = "-"
        self._next_reclaim = 0.0
        self._failures_seen = 0  # the bus's failure count at the last reclaim check
        self._quiet_until = 0.0  # no reclaim before (monotonic): a lease after Redis was last away

    @property
    def dead_letters(self) -> bool:
        """Whether this consumer may dead-letter entries; on a stream it may not (`Keys.reaped_streams`) it
        only releases them, and the dataflow dead-letters them after max_deliveries (`streams.reap`)."""
        return self.stream not in self.bus.keys.reaped_streams()

    def rescan(self) -> None:
        """Take back own pending entries at the next read (after losing track of some)."""
        self._rescan = True

    async def read(self, count: int, block_ms: int | None = None) -> list[Delivery]:
        """Up to `count` entries: own lost ones, reclaimed ones, then new ones (blocking `block_ms`)."""
        if count <= 0:
            return []
        block_ms = self.bus.settings.block_ms if block_ms is None else block_ms
        entries = await self._retrying(self._read, count, block_ms)
        for e in entries:
            self.in_flight[e.id] = e
        return entries

    async def _read(self, count: int, block_ms: int) -> list[Delivery]:
        if self._since_ms is None:
            seconds, micros = await self.bus.redis.time()
            self._since_ms = seconds * 1000 + micros // 1000
        now = time.monotonic()
        if self._rescan or now >= self._next_own_scan:
            self._rescan, self._own_cursor = False, "-"
            self._next_own_scan = now + self.bus.settings.lease_ms / 2000
        failures = self.bus.failures
        try:
            return await self._claim_and_read(count, block_ms)
        finally:
            if self.bus.failures != failures:  # a claim retried after a lost reply: what it got is ours
                self._rescan = True

    async def _claim_and_read(self, count: int, block_ms: int) -> list[Delivery]:
        out: list[Delivery] = []
        while self._own_cursor is not None and len(out) < count:
            cursor, got = await self.bus.claim(
                self.stream,
                self.group,
                self.name,
                mode="own",
                start=self._own_cursor,
                count=count - len(out),
                skip=list(self.in_flight),
                since_ms=self._since_ms,
            )
            out += got
            self._own_cursor = None if cursor == "-" else cursor
        if len(out) < count and self._may_reclaim():
            self._next_reclaim = time.monotonic() + self.bus.settings.lease_ms / 2000
            self._others_cursor, got = await self.bus.claim(
                self.stream,
                self.group,
                self.name,
                mode="others",
                start=self._others_cursor,
                count=count - len(out),
            )
            out += got
        if len(out) < count:
            out += await self.bus.read(
                self.stream, self.group, self.name, count - len(out), None if out else block_ms
            )
        return out

    def _may_reclaim(self) -> bool:
        """Time for a scan of other consumers' entries, and a lease since Redis was last away (the first
        check after a failed call restarts the wait; a check while Redis is still away fails again)."""
        now = time.monotonic()
        if self.bus.failures != self._failures_seen:
            self._failures_seen = self.bus.failures
            self._quiet_until = now + self.bus.settings.lease_ms / 1000 + RENEW_LAG_S
        return now >= self._next_reclaim and now >= self._quiet_until

    async def renew(self) -> list[Delivery]:
        """Renew the leases of everything held; returns (and forgets) entries lost to a reclaim."""
        lost = await self._retrying(self.bus.renew, self.stream, self.group, self.name, list(self.in_flight))
        return [self.in_flight.pop(i) for i in lost if i in self.in_flight]

    async def complete(self, done: Sequence[tuple[Delivery, Sequence[Out]]]) -> list[str]:
        """Publish each entry's outputs and acknowledge it, atomically; returns each item's status."""
        replies = await self.bus.handoff(self.stream, self.group, self.name, done)
        for e, _ in done:
            self.in_flight.pop(e.id, None)
        return [status for status, _ in replies]

    async def release(self, entry: Delivery, reason: str) -> None:
        """Hand an entry back for another delivery (its handler failed): dead after max_deliveries.

        Any consumer may take it next, this one included (its next read rescans its own entries). If the
        release itself fails, the entry is still taken back by the next read (without counting)."""
        try:  # held meanwhile, so that no rescan takes it back before it is marked released
            await self.bus.release(self.stream, self.group, self.name, entry.id, reason)
        finally:
            self.forget(entry.id)

    async def dead_letter(self, entry: Delivery, reason: str) -> None:
        """Send an entry that can never succeed (undecodable, invalid) straight to `dead` (where this
        consumer may: `dead_letters`)."""
        try:
            await self.bus.dead_letter(entry, self.group, self.name, reason)
        finally:
            self.forget(entry.id)  # should it have failed, the next read takes the entry back

    async def give_back(self, entry_ids: Sequence[str], error: BaseException) -> None:
        """Settling the entries `entry_ids` failed with `error`; the next read takes them back. Redis away
        or refusing: without counting a delivery. Anything else: they are released with the error as the
        reason, so an error that repeats still ends in `dead` after max_deliveries. Never raises."""
        for entry_id in entry_ids:
            try:
                if not is_transient(error):
                    reason = f"settling failed: {error!r}"
                    await self.bus.release(self.stream, self.group, self.name, entry_id, reason)
            except Exception:  # Redis gone meanwhile: taken back by the next read all the same
                pass
            finally:
                self.forget(entry_id)

    def settled(self, entry_ids: Sequence[str]) -> None:
        """Stop holding entries that were acknowledged by other means (a caller's own script)."""
        for i in entry_ids:
            self.in_flight.pop(i, None)

    def forget(self, entry_id: str) -> None:
        """Stop holding an entry that could not be settled; the next read takes it back."""
        self.in_flight.pop(entry_id, None)
        self.rescan()

    async def _retrying(self, fn, *args):
        """Run a call through reconnects; recreate the group if Redis lost it."""
        while True:
            try:
                # A lost XREADGROUP or claim reply leaves entries in our pending list: take them back.
                return await self.bus.call(lambda: fn(*args), self.rescan)
            except ResponseError as e:
                if "NOGROUP" not in str(e):
                    raise
                await self.bus.ensure_group(self.stream, self.group)

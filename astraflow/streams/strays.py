"""Stranded prompt groups: in flight, with no prompt or rollout entry left that could ever settle them.

Every step that moves a prompt group (submit, hand-off, collect, dead-letter) changes its entries and the
in-flight set atomically, so a group in flight always has an entry the run's group of its stream has not
acknowledged. A group without one was stranded - its entries deleted, or acknowledged without their
output (what a forged dedup marker once did) - and would count as in flight forever. `Strays` (run by the
feeder) dead-letters a group once it has been stranded for longer than the lease plus STRAY_GRACE_MS;
`stranded_at_least` is the read-only check the ledger makes (see `strays.lua`).
"""

from __future__ import annotations

import time

import structlog

from astraflow.streams.bus import Bus
from astraflow.streams.connection import register_scripts
from astraflow.streams.keys import STRAY_GRACE_MS
from astraflow.streams.scripts import STRAYS

log = structlog.get_logger(__name__)
REASON = (
    "stranded: in flight past its lease + grace with no prompt or rollout entry behind it (its entries were"
    " deleted, or acknowledged without their output)"
)


class Strays:
    """Finds stranded groups and dead-letters those stranded past `lease_ms + grace_ms`.

    A uid's first sighting is kept in this process: after a restart (or in another replica) the clock
    starts again, which only delays settling; the script checks each uid again before settling it."""

    def __init__(self, bus: Bus, grace_ms: int = STRAY_GRACE_MS) -> None:
        self.bus = bus
        self.after_s = (bus.settings.lease_ms + grace_ms) / 1000
        self.seen: dict[str, float] = {}
        self._script = register_scripts(bus.redis, names=(STRAYS.name,))[STRAYS.name]
        self._next = 0.0

    async def sweep(self, now: float | None = None) -> list[str]:
        """Dead-letter groups stranded past the deadline; returns their uids. Runs at most once per half
        lease (returns [] between)."""
        now = time.monotonic() if now is None else now
        if now < self._next:
            return []
        self._next = now + self.bus.settings.lease_ms / 2000
        overdue = [uid for uid, first in self.seen.items() if now - first > self.after_s]
        settled, stranded = await self._call(overdue)
        self.seen = {uid: self.seen.get(uid, now) for uid in stranded}
        if settled:
            log.warning("stranded_dead_lettered", groups=len(settled), uids=settled[:20], reason=REASON)
        return settled

    async def _call(self, settle: list[str]) -> tuple[list[str], list[str]]:
        k, s = self.bus.keys, self.bus.settings
        streams = k.tracked_streams()
        keys, args = STRAYS.call(
            in_flight=k.in_flight,
            dead=k.dead,
            ledger=k.ledger,
            streams=streams,
            dead_maxlen=s.capped_maxlen,
            reason=REASON,
            groups=[k.group_of(x) for x in streams],
            uids=settle,
        )
        settled, stranded = await self.bus.call(lambda: self._script(keys=keys, args=args))
        return [u.decode() for u in settled], [u.decode() for u in stranded]


async def stranded_at_least(bus: Bus) -> int | None:
    """How many groups in flight have no entry behind them, at least: in-flight groups beyond the
    unacknowledged entries of the tracked streams (each in-flight group has one or more), read in one
    transaction with commands every role's user may send (SCARD, XINFO GROUPS). None when Redis does not
    tell: a group's lag (Redis 6.2, or deleted entries in its range), or a stream without the run's group
    (not bootstrapped yet): then it is unchecked."""
    k = bus.keys
    streams = k.tracked_streams()

    async def read():
        async with bus.redis.pipeline(transaction=True) as pipe:
            pipe.scard(k.in_flight)
            for stream in streams:
                pipe.xinfo_groups(stream)
            return await pipe.execute(raise_on_error=False)

    in_flight, *replies = await bus.call(read)
    unacked = 0
    for stream, groups in zip(streams, replies, strict=True):
        if isinstance(groups, Exception):  # no such stream yet: nothing in flight through it
            continue
        mine = [g for g in groups if g["name"].decode() == k.group_of(stream)]
        if not mine or mine[0].get("lag") is None:
            return None
        unacked += int(mine[0]["pending"]) + int(mine[0]["lag"])
    return max(0, int(in_flight) - unacked)

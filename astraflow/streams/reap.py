"""Dead letters of the streams whose consumers may not write them, made by the dataflow.

A RaaS's user may write neither `dead`, the ledger nor the in-flight set (else a RaaS credential could
forge dead letters, drop any group from `in_flight` or inflate the ledger), so a RaaS never dead-letters a
prompt: a failed one is released with its reason, and once it was delivered max_deliveries times its claim
leaves it pending (`Keys.reaped_streams`, claim.lua). The dataflow's `Reaper` dead-letters such entries
every trim interval, as the RaaS's claim once did: the same dead letter (the last error as its reason),
the group settled dead in the ledger and gone from the in-flight set, in one step (claim.lua's 'reap').
"""

from __future__ import annotations

import time

import structlog

from astraflow.streams.bus import Bus
from astraflow.streams.consumer import RENEW_LAG_S

log = structlog.get_logger(__name__)
REAP_COUNT = 100
"""Pending entries one claim.lua call looks at."""


class Reaper:
    """Dead-letters the entries of a reaped stream's run group that were delivered max_deliveries times
    and are idle past the lease (released by a failed handler, or held by an owner that stopped renewing:
    a live holder renews within a third of a lease, so it is never robbed).

    Like a consumer's reclaim, it waits a lease after any call of its bus failed: after a Redis outage
    every pending entry looks idle for the whole downtime."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self._failures_seen = bus.failures
        self._quiet_until = 0.0  # (monotonic) no reaping before: a lease after Redis was last away

    async def sweep(self, stream: str) -> int:
        """Dead-letter what is due on `stream` (one scan of its pending entries idle past the lease);
        returns how many entries went to `dead`."""
        now = time.monotonic()
        if self.bus.failures != self._failures_seen:
            self._failures_seen = self.bus.failures
            self._quiet_until = now + self.bus.settings.lease_ms / 1000 + RENEW_LAG_S
        group = self.bus.keys.group_of(stream)
        if now < self._quiet_until or group is None:
            return 0
        cursor, dead = "-", []
        while True:
            cursor, got = await self.bus.claim(stream, group, "", mode="reap", start=cursor, count=REAP_COUNT)
            dead += got
            if cursor == "-":
                break
        if dead:
            ids = [e.id for e in dead[:20]]
            log.warning("entries_dead_lettered", stream=self.bus.keys.short(stream), n=len(dead), ids=ids)
        return len(dead)

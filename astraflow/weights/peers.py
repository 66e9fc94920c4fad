"""Which peers a puller tries: only those that answered an authenticated probe, a few at a time.

The peer set of a version (`weights:<model>:<version>:peers`) is written by every RaaS, so it may list
endpoints that never serve: a frozen process, or made-up ones added faster than pullers prune them. A
puller probes at most MAX_PROBED of the newest (in parallel, each a handshake that must prove the run
secret within PROBE_TIMEOUT_S) and admits those that answered; one that did not, or that failed a pull
later, is not probed again for BACKOFF_S. So a peer set of silent endpoints costs a pull one probe
timeout, not one handshake timeout per endpoint.
"""

from __future__ import annotations

import asyncio
import ssl
import time

from astraflow.weights.transport import Connection
from astraflow.weights.wire import TransferError

MAX_PROBED = 8
"""Peers probed per pull (the newest first)."""
PROBE_TIMEOUT_S = 1.0
"""A probe's connect and handshake, together."""
BACKOFF_S = 60.0
"""How long a peer that failed a probe or a pull is not tried again."""
MAX_REMEMBERED = 4096
"""Failed peers remembered at most (the oldest back-offs are forgotten first)."""


class Peers:
    """A puller's view of its peers: probes, and the back-off of those that failed."""

    def __init__(self, secret: bytes, model: str, tls: ssl.SSLContext | None = None) -> None:
        self.secret, self.model, self.tls = secret, model, tls
        self.failed: dict[str, float] = {}
        """Endpoint -> when (monotonic) it may be tried again."""
        self.probes = 0

    def backoff(self, endpoint: str) -> None:
        """`endpoint` failed: not tried again for BACKOFF_S."""
        now = time.monotonic()
        self.failed = {e: t for e, t in self.failed.items() if t > now}
        while len(self.failed) >= MAX_REMEMBERED:
            self.failed.pop(next(iter(self.failed)))
        self.failed[endpoint] = now + BACKOFF_S

    async def probe(self, endpoints: list[str], version: int) -> tuple[list[str], list[str]]:
        """(those of `endpoints`, newest first, that answered an authenticated probe for `version`; those
        that did not, now in their back-off). At most MAX_PROBED are probed, none in its back-off."""
        now = time.monotonic()
        candidates = [e for e in endpoints if self.failed.get(e, 0.0) <= now][:MAX_PROBED]
        answered = await asyncio.gather(*(asyncio.to_thread(self._probe, e, version) for e in candidates))
        silent = [e for e, ok in zip(candidates, answered, strict=True) if not ok]
        for endpoint in silent:
            self.backoff(endpoint)
        return [e for e, ok in zip(candidates, answered, strict=True) if ok], silent

    def _probe(self, endpoint: str, version: int) -> bool:
        self.probes += 1
        try:
            conn = Connection(
                endpoint, self.secret, self.model, version, "full", self.tls, PROBE_TIMEOUT_S,
                handshake_timeout_s=PROBE_TIMEOUT_S,
            )  # fmt: skip
        except (TransferError, OSError):
            return False
        conn.close()
        return True

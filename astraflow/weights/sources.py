"""Where a RaaS's pulls of one model come from, and its place in each version's peer set.

A version's bytes cross into a region once: the region's elected relay pulls them (a full buffer from a
peer of the region that answered a probe, when one does, else from the trainer) and the others pull from
the relay while it is still receiving. A relay that dies or stalls is unseated by another election, at
most `RELAY_ROUNDS` times, then the trainer is the source. A source that fails or stalls is left for the
next; a peer that failed is backed off and removed from the version's peer set, so it fails no other
puller. The peer set (`weights:<model>:<version>:peers`, members `region|endpoint`) is joined by every
process holding a version and left when it stops.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import Counter

import structlog

from astraflow.messages import WeightManifest
from astraflow.streams import Bus
from astraflow.weights.peers import Peers
from astraflow.weights.relay import Election
from astraflow.weights.server import WeightServer
from astraflow.weights.settings import WeightsSettings
from astraflow.weights.transport import pull
from astraflow.weights.wire import TransferError

log = structlog.get_logger(__name__)
RELAY_ROUNDS = 3
"""Elections one pull tries (a relay found dead or stalled is unseated) before going to the trainer."""


class Sources:
    """The sources of one receiver's pulls of `model` in `region`, its counts added to `stats`."""

    def __init__(
        self,
        bus: Bus,
        settings: WeightsSettings,
        model: str,
        region: str,
        secret: bytes,
        server: WeightServer,
        election: Election,
        peers: Peers,
        tls: ssl.SSLContext | None,
        stats: Counter[str],
    ) -> None:
        self.bus, self.settings, self.model, self.region = bus, settings, model, region
        self.secret, self.server, self.election, self.peers = secret, server, election, peers
        self._tls, self.stats = tls, stats
        self._joined: dict[int, float] = {}
        """Versions whose peers this process joined, and when (`leave` takes it out of them)."""

    async def in_region(self, manifest: WeightManifest, what: str, into, on_bytes, deadline) -> None:
        """Pull `what` of the version the region's way (see the module doc), `on_bytes` told of each range
        as it arrives (a relay serving it meanwhile)."""
        version, failed = manifest.version, ""
        for _ in range(RELAY_ROUNDS):
            seat = await self.election.elect(manifest, what, failed)
            if seat == self.server.endpoint:  # this process crosses the long link for the region
                holders = []
                if what == "full":  # the peers that answer a probe, itself aside; the others are pruned
                    listed = [e for e in await self._listed(version) if e != self.server.endpoint]
                    holders, silent = await self.peers.probe(listed, version)
                    for endpoint in silent:
                        await self._drop(version, endpoint)
                    await self.join(version)
                sources = holders + list(manifest.endpoints)
                await self.from_any(sources, holders, version, what, into, deadline, on_bytes)
                self.stats["relay_pulls"] += 1
                return
            try:
                await self.from_any([seat], [], version, what, into, deadline, on_bytes)
                self.stats["relayed_pulls"] += 1
                return
            except TransferError:
                failed = seat
                self.stats["relay_failovers"] += 1
                if what == "full":  # nor is it a holder to try (a stalled one would stall the next relay)
                    await self._drop(version, seat)
                log.warning("weights_relay_failed", model=self.model, version=version, what=what, relay=seat)
        await self.from_any(list(manifest.endpoints), [], version, what, into, deadline, on_bytes)

    async def from_any(
        self, endpoints: list[str], peers: list[str], version: int, what: str, into, deadline, on_bytes=None
    ) -> None:
        """Pull from the first of `endpoints` that works before `deadline`; those of `peers` that fail are
        removed from the version's peers."""
        errors = []
        for endpoint in endpoints:
            if endpoint == self.server.endpoint:
                continue
            try:
                await asyncio.to_thread(
                    pull,
                    endpoint,
                    self.secret,
                    self.model,
                    version,
                    what,
                    into,
                    self.settings.parallel,
                    on_bytes,
                    tls=self._tls,
                    io_timeout_s=self.settings.io_timeout_s,
                    deadline=deadline,
                    handshake_timeout_s=self.settings.handshake_timeout_s,
                )
                self.stats["bytes"] += len(into)
                return
            except (TransferError, OSError) as e:  # refused, reset, timed out: the next source
                errors.append(f"{endpoint}: {e!r}")
                log.warning("weights_source_failed", model=self.model, version=version, endpoint=endpoint)
                if endpoint in peers:
                    self.peers.backoff(endpoint)
                    await self._drop(version, endpoint)
            if time.monotonic() >= deadline:
                break
        raise TransferError(f"{self.model} v{version} {what}: no source worked ({'; '.join(errors)})")

    async def _listed(self, version: int) -> list[str]:
        """Endpoints of peers in this region that hold or receive `version`, newest first."""
        key = self.bus.keys.weight_peers(self.model, version)
        members = await self.bus.read_only(lambda r: r.zrevrange(key, 0, -1))
        out = []
        for m in members:
            region, _, endpoint = m.decode().partition("|")
            if region == self.region:
                out.append(endpoint)
        return out

    async def _drop(self, version: int, endpoint: str) -> None:
        """Remove a peer that failed to serve `version` from its peers (it would fail the next puller)."""
        key, member = self.bus.keys.weight_peers(self.model, version), f"{self.region}|{endpoint}"
        await self.bus.call(lambda: self.bus.redis.zrem(key, member))
        self.stats["peers_pruned"] += 1

    async def join(self, version: int) -> None:
        """List this process among the peers of `version` in its region (for `manifest_ttl_s`)."""
        key = self.bus.keys.weight_peers(self.model, version)
        member = f"{self.region}|{self.server.endpoint}"
        ttl = self.settings.manifest_ttl_s

        async def add():
            async with self.bus.redis.pipeline(transaction=True) as pipe:
                await pipe.zadd(key, {member: time.time()}).expire(key, ttl).execute()

        await self.bus.call(add)
        self._joined[version] = time.monotonic()

    async def leave(self) -> None:
        """Out of every version's peers it joined (those not expired since) and off every relay seat it
        holds. One try each, no reconnects: a stopping RaaS does not wait out an outage."""
        fresh = time.monotonic() - self.settings.manifest_ttl_s
        member = f"{self.region}|{self.server.endpoint}"
        versions = [v for v, at in self._joined.items() if at >= fresh]
        self._joined = {}
        for version in versions:
            await self.bus.redis.zrem(self.bus.keys.weight_peers(self.model, version), member)
        await self.election.resign()

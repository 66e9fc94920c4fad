"""The RaaS's side of the weight manager: pull, patch, verify, hand over, relay.

For each announced version: read the manifest; pull the delta when this process holds exactly the base
version's bytes (same digest), else the full buffer (on the trainer's host copied from the trainer's
file, `local`: a file that differs from the manifest is left for a pull); verify before anyone sees the
bytes: a full buffer chunk by chunk as it arrives (`verify`), a delta by its own digest (applied to the
held, verified base, it gives exactly the manifest's bytes: nothing is read again). Either kind pulled
crosses into a region once
(`relay`): the region's elected relay pulls it from the trainer (a full buffer from a peer of the region
that holds it, when one does), and the others pull it from the relay while it is still receiving; a
relay that dies or stalls is replaced by another election (`sources`, where pulls come from). A
mismatch raises WeightIntegrityError inside, is logged and counted, and the version is pulled again in
full from the trainer. Once verified, this process serves the version (and the delta that made it)
until it is replaced. A source that fails or stalls (past `io_timeout_s`) is left for the next one, and
a failed peer is removed from the version's peers; each attempt gives up after `pull_deadline_s` over
all its sources. Only peers that answered an authenticated probe are tried, and one that failed is left
alone for a while (`peers`).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

import structlog

from astraflow.errors import ForeignAdapterError, WeightIntegrityError
from astraflow.messages import WeightManifest, decode
from astraflow.streams import Bus
from astraflow.weights import adapters, codec, files, layout, local, wire
from astraflow.weights.buffer import DoubleBuffer, Half
from astraflow.weights.peers import Peers
from astraflow.weights.relay import Election, Spool
from astraflow.weights.server import WeightServer
from astraflow.weights.settings import WeightsSettings
from astraflow.weights.sources import Sources
from astraflow.weights.transport import Source
from astraflow.weights.verify import ChunkVerifier
from astraflow.weights.wire import TransferError

log = structlog.get_logger(__name__)


class WeightReceiver:
    def __init__(
        self,
        bus: Bus,
        settings: WeightsSettings,
        model: str,
        root: Path,
        secret: bytes,
        server: WeightServer,
        region: str = "local",
        model_dir: Path | None = None,
    ) -> None:
        self.bus, self.settings, self.model, self.root = bus, settings, model, root / model
        self.secret, self.server, self.region, self.model_dir = secret, server, region, model_dir
        self.buffer: DoubleBuffer | None = None
        self.held: tuple[int, str] | None = None
        """(version, digest) of the verified served half."""
        self.stats: Counter[str] = Counter()
        self.timings: dict[str, float] = {}
        """Seconds of the last pull's stages: `pull` (bytes in), `verify` (left after the last byte),
        `apply` (a delta onto the base)."""
        self._tls = wire.tls_contexts(settings)[1]
        self._spool: tuple[int, Spool] | None = None
        """(version, spool) of the delta this process serves to its region."""
        self.election = Election(bus, model, region, server.endpoint, settings.manifest_ttl_s)
        self.peers = Peers(secret, model, self._tls)
        self.sources = Sources(
            bus, settings, model, region, secret, server, self.election, self.peers, self._tls, self.stats
        )
        """Where pulls come from (the region's relay, peers, the trainer) and this process's peer sets."""
        self._manifest: WeightManifest | None = None
        """The manifest the served half was verified against."""
        self._adapter_config = ""
        """The adapter config the halves' directories hold ('' = full weights)."""

    async def sync(self, manifest_key: str, version: int) -> Half:
        """Make `version` the served half, verified; returns it (hold it with `buffer.reading` to load)."""
        fields = await self.bus.read_only(lambda r: r.hgetall(manifest_key), fresh=bool)  # (replica lag)
        if not fields:
            raise TransferError(f"manifest {manifest_key} is gone")
        manifest = decode(fields, WeightManifest)
        if manifest.adapter_of:
            await self._check_base(manifest)
        if self.held == (manifest.version, manifest.digest):
            return self.buffer.served  # type: ignore[union-attr]
        self._ensure_buffer(manifest)
        try:
            half = await self._pull(manifest, first_try=True)
        except (WeightIntegrityError, TransferError) as e:
            self.stats["integrity_errors" if isinstance(e, WeightIntegrityError) else "transfer_errors"] += 1
            log.error("weights_refused", model=self.model, version=version, error=str(e))
            half = await self._pull(manifest, first_try=False)
        await self.sources.join(manifest.version)
        return half

    async def check_served(self, half: Half) -> None:
        """Digest `half` (the served half, held for reading) again against the manifest it was verified
        against, just before an engine loads it: bytes changed since (by whatever can write this
        process's buffer) raise WeightIntegrityError, and the next `sync` pulls the version again. BLAKE3
        over the hash pool: a fraction of what the engine's own read of the same bytes costs."""
        manifest = self._manifest
        try:
            if manifest is None or half.version != manifest.version:
                raise WeightIntegrityError(f"{self.model}: the half to load is not the verified one")
            await asyncio.to_thread(ChunkVerifier(half.data, manifest).check)
        except WeightIntegrityError:
            self.held = None
            self.stats["integrity_errors"] += 1
            raise

    @property
    def served_manifest(self) -> WeightManifest | None:
        """The manifest the served half was verified against."""
        return self._manifest

    def delta_of(self, version: int) -> bytes | None:
        """The verified delta that made `version`, when this process pulled one (else None)."""
        if self._spool is None or self._spool[0] != version:
            return None
        return self._spool[1].data()

    async def _check_base(self, manifest: WeightManifest) -> None:
        """Raise ForeignAdapterError unless the adapter's base is the model this process serves (its
        `model_dir`, digested once)."""
        if self.model_dir is None:
            raise ForeignAdapterError(f"{self.model} v{manifest.version}: an adapter, and no base is held")
        held = await asyncio.to_thread(adapters.base_digest, str(self.model_dir))
        if held != manifest.adapter_of:
            self.stats["foreign_adapters"] += 1
            raise ForeignAdapterError(
                f"{self.model} v{manifest.version}: an adapter of base {manifest.adapter_of}, this process"
                f" holds {held} ({self.model_dir}): start the trainer and the engine from the same weights"
            )

    def _ensure_buffer(self, manifest: WeightManifest) -> None:
        same = self.buffer is not None and layout.header(self.buffer.specs) == layout.header(manifest.tensors)
        if same and self._adapter_config == manifest.adapter_config:
            return
        if self.buffer is not None:
            self.buffer.close()
        self.buffer = DoubleBuffer(self.root, manifest.tensors, self.settings.reader_grace_s)
        if manifest.adapter_of:  # each half a PEFT adapter directory
            for half in self.buffer.halves:
                adapters.make_adapter_dir(half.dir, manifest.adapter_config, half.path.name)
        elif self.model_dir is not None:
            self.buffer.add_files(files.checkpoint_files(self.model_dir))
        self._adapter_config = manifest.adapter_config
        self.held = None

    async def _pull(self, manifest: WeightManifest, first_try: bool) -> Half:
        buffer = self.buffer
        assert buffer is not None
        idle_version = buffer.idle.version
        if idle_version is not None:
            self.server.unregister(self.model, idle_version, "full")  # no new readers of what we overwrite
        base = (manifest.base_version, manifest.base_digest)
        deadline = time.monotonic() + self.settings.pull_deadline_s
        use_delta = first_try and manifest.delta_digest and self.held == base and manifest.kind == "delta"
        half = await asyncio.to_thread(buffer.claim)
        started = time.perf_counter()
        try:
            if use_delta:  # verified: the delta's digest, applied to the held base's bytes
                delta = await self._pull_delta(manifest, deadline)
                pulled = time.perf_counter()
                served = buffer.served.data  # type: ignore[union-attr]
                await asyncio.to_thread(codec.apply, half.data, delta, served)  # copies as it patches
                self.stats["delta_pulls"] += 1
                applied = time.perf_counter() - pulled
                self.timings = {"pull": pulled - started, "verify": 0.0, "apply": applied}
            else:  # verified chunk by chunk as the bytes arrive
                verifier = ChunkVerifier(half.data, manifest)
                if not await self._copy_local(manifest, verifier):
                    verifier = ChunkVerifier(half.data, manifest)
                    await self._pull_full(manifest, half, first_try, deadline, verifier.arrived)
                pulled = time.perf_counter()
                await asyncio.to_thread(verifier.check)
                verified = time.perf_counter() - pulled
                self.timings = {"pull": pulled - started, "verify": verified, "apply": 0.0}
        except WeightIntegrityError:
            self.server.unregister(self.model, manifest.version, "full")
            raise
        buffer.flip(manifest.version)
        self.held, self._manifest = (manifest.version, manifest.digest), manifest
        source = Source(
            half.fileno(), half.data_offset, len(half.data), hold=lambda cut: buffer.reading(half, cut)
        )
        self.server.register(self.model, manifest.version, "full", source)
        return half

    async def _copy_local(self, manifest: WeightManifest, verifier: ChunkVerifier) -> bool:
        """Copy the version from the trainer's file when it is on this host (`local`), verified; False when
        it is no source here or a chunk differs (a half the trainer has written since): pull it."""
        if not self.settings.same_host:
            return False
        try:
            copied = await asyncio.to_thread(local.copy, manifest, verifier)
        except WeightIntegrityError as e:
            self.stats["local_misses"] += 1
            log.warning(
                "weights_local_copy_refused", model=self.model, version=manifest.version, error=str(e)
            )
            return False
        self.stats["local_copies"] += copied
        return copied

    async def _pull_delta(self, manifest: WeightManifest, deadline: float) -> bytes:
        """The version's delta, through the region's relay; served to the region from then on."""
        spool = Spool(files.private_dir(self.root / "deltas"), manifest.delta_nbytes)
        self.server.register(self.model, manifest.version, "delta", spool.source)
        try:
            await self.sources.in_region(manifest, "delta", spool.view, spool.source.arrived, deadline)
            delta = spool.data()
            if layout.chunk_digest(delta) != manifest.delta_digest:
                raise WeightIntegrityError(f"{self.model} v{manifest.version}: delta digest mismatch")
        except BaseException:
            self.server.unregister(self.model, manifest.version, "delta")
            spool.close()
            raise
        if self._spool is not None:
            self.server.unregister(self.model, self._spool[0], "delta")
            self._spool[1].close()
        self._spool = (manifest.version, spool)
        return delta

    async def _pull_full(
        self, manifest: WeightManifest, half: Half, relayed: bool, deadline: float, on_bytes
    ) -> None:
        """Pull the full buffer into `half` (through the region's relay with `relayed`, else from the
        trainer), serving what has arrived to peers meanwhile and telling `on_bytes` of each range."""
        relay = Source(half.fileno(), half.data_offset, len(half.data), complete=False)

        def arrived(start: int, end: int) -> None:
            relay.arrived(start, end)
            on_bytes(start, end)

        self.server.register(self.model, manifest.version, "full", relay)
        try:
            if relayed:
                await self.sources.in_region(manifest, "full", half.data, arrived, deadline)
            else:
                v, trainer = manifest.version, list(manifest.endpoints)
                await self.sources.from_any(trainer, [], v, "full", half.data, deadline, arrived)
        except BaseException:
            relay.fail()
            raise
        self.stats["full_pulls"] += 1

    async def leave(self) -> None:
        """Stop being a source: out of every version's peers it joined (those not expired since) and off
        every relay seat it holds, so that no puller tries a stopped process (`weights_source_failed`).
        One try each, no reconnects: a stopping RaaS does not wait out an outage."""
        await self.sources.leave()

    def close(self) -> None:
        if self._spool is not None:
            self._spool[1].close()
        if self.buffer is not None:
            self.buffer.close()

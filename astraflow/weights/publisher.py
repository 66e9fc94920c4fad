"""The trainer's side of the weight manager: offload, delta, digest, serve, manifest, `versions`.

`publish` copies the new weights into the idle half of the double buffer - the only part on the
trainer's critical path - and returns. A background task then scans the half in parallel threads
(digests, the elements changed since the served one, none NaN or inf), encodes the delta, flips, serves
both over TCP, writes the manifest `weights:<model>:<version>` and adds the entry to `versions`. The
next `publish` first waits for that task, so the halves stay consistent.

Where `weights.build_on` says so (`auto`: weights on CUDA), `publish` only enqueues a cast-copy into a
slot on the weights' device (`weights.on_device`); the background then checks, compares and lands the
version there, and also writes the record engines on this host map it by (`weights.share`).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass
from pathlib import Path

import structlog

from astraflow.errors import NonFiniteWeights, describe
from astraflow.messages import VersionPublished, WeightManifest, encode
from astraflow.streams import Bus, Out
from astraflow.streams.connection import register_scripts
from astraflow.streams.runstate import last_notice
from astraflow.weights import codec, layout, local, on_device, scan, share
from astraflow.weights.buffer import DoubleBuffer, Half
from astraflow.weights.scripts import MANIFEST
from astraflow.weights.served_files import ServedFiles
from astraflow.weights.server import WeightServer
from astraflow.weights.settings import WeightsSettings
from astraflow.weights.transport import Source

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Adapter:
    """What makes a publisher's versions LoRA adapters (`weights.adapters`)."""

    base_digest: str
    """`adapters.base_digest` of the frozen base the adapter applies to."""
    config: str
    """PEFT's `adapter_config.json` text."""


class WeightPublisher:
    def __init__(
        self,
        bus: Bus,
        settings: WeightsSettings,
        model: str,
        specs,
        root: Path,
        secret: bytes,
        adapter: Adapter | None = None,
    ) -> None:
        self.bus, self.settings, self.model, self.specs = bus, settings, model, specs
        self.adapter = adapter
        """Set: every version is this LoRA adapter's tensors (the manifest says of which base)."""
        self.incarnation = uuid.uuid4().hex[:12]
        self.buffer = DoubleBuffer(root / model, specs, settings.reader_grace_s)
        self.server = WeightServer.from_settings(secret, settings)
        self.deltas = ServedFiles(self.server, model, "delta", root / model / "deltas")
        self.evals = ServedFiles(self.server, model, "full", root / model / "evals")
        """Copies of eval versions the barrier has not passed yet (see `_keep_evals`)."""
        self._eval_halves: set[int] = set()  # eval versions served from a half
        self._finishing: asyncio.Task | None = None
        self._publishing = asyncio.Lock()
        self.timings: dict[str, float] = {}
        """Seconds of the last version's background stages: `scan` (digests, changes), `delta` (encode)."""
        self._digest = ""  # of the served version
        self._manifest: WeightManifest | None = None  # of the served version
        self.on_device: on_device.DeviceVersions | None = None
        """Versions built on the trainer's device (`weights.build_on`), chosen at the first `publish`."""
        self._chosen = False
        scripts = register_scripts(bus.redis, "astraflow.weights", (MANIFEST.name,))
        self._write_manifest = scripts[MANIFEST.name]

    async def publish(
        self,
        state: Mapping,
        version: int,
        step: int,
        eval_: bool = False,
        durable: Awaitable | None = None,
        once: bool = True,
    ) -> None:
        """Offload `state` as `version`; the rest happens in the background (see `wait`), and the version
        is served and announced only once `durable` (the checkpoint that holds it) is done. With `once`
        a version is announced in `versions` at most once, whichever trainer publishes it (a restarted
        trainer republishing a durable version rewrites the manifest, so receivers find its new
        endpoint, and adds no entry); otherwise once per incarnation (a version no checkpoint holds,
        which a restarted trainer trains again, differently)."""
        async with self._publishing:  # one writer of the idle half at a time, in call order
            await self.wait()
            if not self._chosen:  # where versions are built, decided once (`weights.build_on`)
                self._chosen = True
                self.on_device = on_device.for_state(state, self.specs, self.settings, self.model)
            half = None
            if self.on_device is not None:
                await self.on_device.take(state)
            else:
                half = await asyncio.to_thread(self.buffer.write_state, state)
            self._finishing = asyncio.create_task(self._finish(half, version, step, eval_, durable, once))

    async def _keep_evals(self, idle: int | None) -> None:
        """After a flip, in the background while the trainer trains on: an eval version the flip left in
        the idle half (which the next `publish` writes) goes on being served from a copy while the
        barrier has not passed it (announced no later version); copies of passed ones are dropped. The
        barrier announces an eval version once the slowest trainer reached it, and every RaaS then loads
        exactly it, so a trainer that ran ahead must still serve it."""
        if idle not in self._eval_halves and not self.evals.versions:
            return
        notice = await last_notice(self.bus)
        self.evals.drop(v for v in self.evals.versions if v < notice)
        if idle not in self._eval_halves:
            return
        self._eval_halves.discard(idle)
        if idle >= notice:
            try:
                await asyncio.to_thread(self.evals.add, idle, self.buffer.idle.data)
                return  # served from the copy now
            except OSError as e:  # a full disk: its eval cannot run on a RaaS that did not load it yet
                log.error("eval_copy_failed", model=self.model, version=idle, error=describe(e))
        self.server.unregister(self.model, idle, "full")

    async def wait(self) -> None:
        """Until the last published version is announced (its manifest and `versions` entry written)."""
        if self._finishing is not None:
            task, self._finishing = self._finishing, None
            await task

    async def _finish(
        self, half: Half | None, version: int, step: int, eval_: bool, durable: Awaitable | None, once: bool
    ) -> None:
        base = self.buffer.served
        if self._manifest is not None and base is not None and base.version == version:
            # The served version again (a clean stop's checkpoint): the same weights. Its manifest, its
            # delta and its half stay; a new delta (of it against itself) would replace them under
            # receivers pulling it.
            if durable is not None:
                await durable
            await self._notify(self._manifest, step, eval_, once)  # its peers still hold these bytes
            return
        full_due = version % self.settings.full_every == 0  # then no delta is offered (nor computed)
        compare = base is not None and base.version is not None and not full_due
        started = time.perf_counter()
        served = (
            self._manifest if compare and self._manifest and self._manifest.version == base.version else None
        )
        checked = None
        if half is None:  # built on the device: checked there, then landed in the host half
            checked = await asyncio.to_thread(self.on_device.check)  # type: ignore[union-attr]
            if checked.nonfinite:
                raise NonFiniteWeights(f"{self.model} v{version}: {checked.nonfinite} weights are NaN or inf")
            half = await asyncio.to_thread(self.buffer.claim)
            seen = await asyncio.to_thread(self.on_device.land, half, compare)  # type: ignore[union-attr]
        else:
            seen = await asyncio.to_thread(
                scan.scan,
                half.data,
                base.data if compare else None,
                self.settings.dtype,
                old_digests=served.chunk_digests if served is not None else None,  # of the served bytes
            )
        self.timings = {"scan": time.perf_counter() - started, "delta": 0.0}
        if seen.nonfinite:  # the trainer checks its steps; this is the last line before any engine
            raise NonFiniteWeights(f"{self.model} v{version}: {seen.nonfinite} weights are NaN or inf")
        whole, chunks = seen.digest, seen.chunk_digests
        base_digest, self._digest = self._digest, whole
        delta_nbytes, delta_digest = 0, ""
        if seen.parts is not None and base is not None:
            itemsize = self.buffer.itemsize
            n = len(half.data) // itemsize
            delta = await asyncio.to_thread(codec.encode_parts, seen.parts, n, itemsize)
            self.timings["delta"] = time.perf_counter() - started - self.timings["scan"]
            if len(delta) < len(half.data):  # else most elements changed: the full buffer is smaller
                digest = layout.chunk_digest(delta)
                try:
                    self.deltas.add(version, delta)
                    delta_nbytes, delta_digest = len(delta), digest
                except OSError as e:  # a full disk: receivers pull the full buffer
                    log.warning("delta_not_served", model=self.model, version=version, error=describe(e))
                self.deltas.drop(self.deltas.versions[: -self.settings.keep_deltas])
        if durable is not None:
            await durable
        old = base.version if base is not None else None
        self.buffer.flip(version)
        if self.on_device is not None and checked is not None:
            self.on_device.flip()
        source = Source(
            half.fileno(), half.data_offset, len(half.data), hold=lambda cut: self.buffer.reading(half, cut)
        )
        self.server.register(self.model, version, "full", source)
        if old is not None and old not in self._eval_halves:
            self.server.unregister(self.model, old, "full")  # its half is written next
        if eval_:
            self._eval_halves.add(version)  # served from its half until that is written (`_keep_evals`)
        full = not delta_digest
        manifest = WeightManifest(
            uid=f"{self.model}:{version}:{self.incarnation}",
            model=self.model,
            version=version,
            kind="full" if full else "delta",
            base_version=old,
            endpoints=[self.server.endpoint],
            nbytes=len(half.data),
            digest=whole,
            chunk_digests=chunks,
            tensors=self.specs,
            incarnation=self.incarnation,
            chunk_bytes=layout.CHUNK_BYTES,
            delta_nbytes=delta_nbytes,
            delta_digest=delta_digest,
            base_digest=base_digest,
            file=local.describe(half.path, half.data_offset),
            device_checksum=checked.checksum if checked is not None else "",
            adapter_of=self.adapter.base_digest if self.adapter else "",
            adapter_config=self.adapter.config if self.adapter else "",
        )
        self._manifest = manifest
        if checked is not None:
            await self._share(manifest)
        await self._announce(manifest, step, eval_, once)
        await self._keep_evals(old)

    async def _share(self, manifest: WeightManifest) -> None:
        """Say where engines on this host map the version (`weights.share`), before it is announced."""
        on = self.on_device
        record = on.shared(self.model, manifest.version, manifest.device_checksum, manifest.file)  # type: ignore[union-attr]
        if record is not None:
            await share.put(self.bus, record, self.settings.manifest_ttl_s)

    async def _announce(self, manifest: WeightManifest, step: int, eval_: bool, once: bool) -> None:
        key = self.bus.keys.weights(self.model, manifest.version)
        peers = self.bus.keys.weight_peers(self.model, manifest.version)
        keys, args = MANIFEST.call(
            manifest=key, peers=peers, ttl_s=self.settings.manifest_ttl_s, fields=encode(manifest)
        )
        # A hand-off like the version's: with redis.min_replicas_ack, done only once replicas have it, so a
        # version announced after a failover never names a manifest the old primary took with it.
        await self.bus.hand_off_script(self._write_manifest, keys, args)
        await self._notify(manifest, step, eval_, once)

    async def _notify(self, manifest: WeightManifest, step: int, eval_: bool, once: bool) -> None:
        """Add the version to `versions` (which the dataflow turns into notices)."""
        key = self.bus.keys.weights(self.model, manifest.version)
        msg = VersionPublished(
            uid=manifest.uid,
            model=self.model,
            version=manifest.version,
            manifest_key=key,
            step=step,
            incarnation=self.incarnation,
            eval=eval_,
        )
        dedup = f"version:{self.model}:{manifest.version}" + ("" if once else f":{self.incarnation}")
        await self.bus.publish(Out(self.bus.keys.versions, encode(msg), dedup))
        log.info(
            "weights_published",
            model=self.model,
            version=manifest.version,
            kind=manifest.kind,
            delta_bytes=manifest.delta_nbytes,
            full_bytes=manifest.nbytes,
        )

    async def close(self) -> None:
        await self.wait()
        self.server.close()
        self.deltas.close()
        self.evals.close()
        self.buffer.close()

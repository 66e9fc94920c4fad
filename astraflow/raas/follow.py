"""A RaaS's weights follow the `notices` stream: each notice's versions pulled, verified and loaded.

Notices carry absolute versions, so only the newest of a batch is applied. A non-eval notice loads what
is newer than the engine holds; an eval notice (and every notice in sync mode) loads exactly its
version, and holds new episodes back (`synced`) until it is loaded. Workers wait on `loaded` for the
versions a prompt group needs (`at_least`, `at_eval_version`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import Mapping
from contextlib import nullcontext
from pathlib import Path

import structlog

from astraflow.engines import Engine
from astraflow.errors import WeightIntegrityError, describe
from astraflow.messages import VersionNotice, WeightManifest, decode
from astraflow.raas.device_load import DeviceLoader
from astraflow.raas.metrics import Metrics
from astraflow.streams import Bus
from astraflow.streams.connection import raise_if_cancelled
from astraflow.weights.files import verify_checkpoint
from astraflow.weights.published import newest_published
from astraflow.weights.receiver import WeightReceiver

log = structlog.get_logger(__name__)


class NoticeFollower:
    def __init__(
        self,
        bus: Bus,
        engines: Mapping[str, Engine],
        receivers: Mapping[str, WeightReceiver],
        metrics: Metrics,
    ) -> None:
        self.bus, self.engines, self.receivers, self.metrics = bus, engines, receivers, metrics
        self.noticed = -1
        """The version of the last notice applied."""
        self.synced = asyncio.Event()  # cleared while an eval notice is being loaded
        self.synced.set()
        self._incarnations: dict[str, str] = {}
        """Model -> trainer incarnation of the loaded weights (from the notices)."""
        self._loads = asyncio.Lock()
        self._loaded = asyncio.Condition()  # notified after every weight load and applied notice
        self.device_loads = DeviceLoader(bus)
        """Versions into engines that take tensors: device to device, no files (`raas.device_load`)."""

    async def at_least(self, models: list[str], version: int) -> None:
        """Wait until `models` are loaded at `version` or newer."""
        async with self._loaded:
            await self._loaded.wait_for(lambda: all(self.engines[m].version >= version for m in models))

    async def at_eval_version(self, models: list[str], version: int) -> bool:
        """Wait until the notice of eval version `version` is applied, `models` loaded at exactly it (True:
        the barrier holds later notices meanwhile), or a later notice was (False: the barrier gave up
        waiting for this eval). Engines that merely passed through `version` while another notice was
        being applied do not count: they may move on under the episodes."""
        async with self._loaded:
            await self._loaded.wait_for(lambda: self.noticed >= version)
            return self.noticed == version and all(self.engines[m].version == version for m in models)

    async def run(self) -> None:
        """Apply the latest notice at start (catching up), then the newest of each batch that arrives
        (notices carry absolute versions: an older one in the same batch has nothing left to load). A
        notice whose load failed is retried at once with each model's newest published version (a
        trainer ahead of the others serves the noticed one no longer once it has published the next),
        then again while no newer notice arrives (its manifest may name a trainer that restarted since,
        and the restarted one rewrites it with its own endpoint)."""
        stream, cursor, failed = self.bus.keys.notices, None, None
        while True:
            try:
                if cursor is None:
                    entries = await self.bus.read_only(lambda r: r.xrevrange(stream, count=1))
                else:
                    reply = await self.bus.read_only(
                        functools.partial(_read_notices, stream, cursor, self.bus.settings.block_ms),
                        blocking=True,
                    )
                    entries = reply[0][1] if reply else []
            except Exception as e:  # Redis away or refusing: keep following, it is the weights' only path
                raise_if_cancelled()
                log.warning("notices_unreachable", error=describe(e))
                await asyncio.sleep(0.5)
                continue
            cursor = entries[-1][0].decode() if entries else (cursor or "0-0")
            retry = entries[-1][1] if entries else failed
            if retry is not None:
                ok = await self._apply(retry) or await self._apply(retry, newest=True)
                failed = None if ok else retry

    async def _load(self, model: str, engine: Engine, version: int, notice: VersionNotice) -> bool:
        """Get the version's weights (pulled and verified while generation goes on), digest them again
        once held for the load (`WeightReceiver.check_served`), then pause, load, resume. A shared
        checkpoint directory in the notice is loaded instead, once its weights match the digest of the
        version's manifest (WeightIntegrityError otherwise). False: the notice names no weights of
        `model`."""
        started = time.perf_counter()
        receiver, manifest = self.receivers.get(model), notice.manifests.get(model)
        half = None
        if model in notice.checkpoints:  # no transfer, but no trust either: checked against the manifest
            hold, path = nullcontext(), notice.checkpoints[model]
            await self._verify_checkpoint(path, manifest)
        elif (
            receiver is not None
            and manifest
            and getattr(engine, "tensors_device", None)
            and await self._load_tensors(model, engine, receiver, manifest, version)
        ):
            hold, path = nullcontext(), None  # loaded by `_load_tensors`, no file read
        elif receiver is not None and manifest:
            half = await receiver.sync(manifest, version)
            hold, path = receiver.buffer.reading(half), str(half.dir)  # type: ignore[union-attr]
        else:
            return False
        pulled = time.perf_counter()
        with hold:
            if half is not None:  # verified when pulled; checked again as the engine is about to read it
                await receiver.check_served(half)  # type: ignore[union-attr]
            if path is not None:
                try:
                    await engine.pause()
                    await engine.load_weights(path, version)
                finally:
                    await engine.resume()
        async with self._loaded:
            self._loaded.notify_all()
        self.metrics.loaded(time.perf_counter() - started)
        log.info(
            "weights_loaded",
            model=model,
            version=version,
            pull_s=pulled - started,
            load_s=time.perf_counter() - pulled,
            way="files" if path is not None else self.device_loads.last.get(model),
        )
        return True

    async def _load_tensors(
        self, model: str, engine: Engine, receiver: WeightReceiver, manifest_key: str, version: int
    ) -> bool:
        """The version into an engine that takes tensors (`raas.device_load`): shared by the trainer on
        this host, else pulled by the receiver and applied (a delta) or copied (a half) on the device.
        False, with nothing loaded, for a LoRA adapter: the engine reads it as PEFT's directory."""
        fields = await self.bus.read_only(lambda r: r.hgetall(manifest_key), fresh=bool)
        manifest = decode(fields, WeightManifest) if fields else None
        if manifest is not None and manifest.adapter_of:
            return False
        if manifest is None or manifest.version != version:
            manifest = None  # gone or replaced: the receiver's sync says so
        elif await self.device_loads.shared(model, engine, manifest):
            return True
        half = await receiver.sync(manifest_key, version)
        manifest = manifest or receiver.served_manifest
        if manifest is not None and manifest.adapter_of:
            return False
        with receiver.buffer.reading(half):  # type: ignore[union-attr]
            await receiver.check_served(half)
            delta = receiver.delta_of(version)
            await self.device_loads.from_half(model, engine, manifest, half, delta)
        return True

    async def _verify_checkpoint(self, path: str, manifest_key: str | None) -> None:
        fields = {}
        if manifest_key:
            fields = await self.bus.read_only(lambda r: r.hgetall(manifest_key), fresh=bool)
        if not fields:
            raise WeightIntegrityError(f"checkpoint {path}: no manifest to check it against")
        await asyncio.to_thread(verify_checkpoint, Path(path), decode(fields, WeightManifest))

    async def _apply(self, fields: dict, newest: bool = False) -> bool:
        """Load what the notice names (with `newest`, each model's newest published version where that is
        newer; not for eval notices, which are exact); False when a load failed."""
        try:
            notice = decode(fields, VersionNotice)
        except Exception as e:  # a bad notice must not stop the worker from following the next ones
            log.error("bad_notice", error=describe(e))
            return True
        if newest:
            if notice.eval:  # exact: nothing else to try
                return False
            notice = await self._with_newest(notice)
        async with self._loads:
            if notice.eval:
                self.synced.clear()
            try:
                for model, version in notice.models.items():
                    engine = self.engines.get(model)
                    if engine is None:
                        continue
                    incarnation = notice.incarnations.get(model)
                    same = incarnation is None or incarnation == self._incarnations.get(model, incarnation)
                    # Nothing newer: skipped. An eval notice is exact (an engine ahead goes back to it);
                    # weights of a dead incarnation are replaced, even by older ones.
                    current = version == engine.version if notice.eval else version <= engine.version
                    if current and same:
                        continue
                    if await self._load(model, engine, version, notice) and incarnation is not None:
                        self._incarnations[model] = incarnation
            except Exception as e:
                log.error("weights_load_failed", version=notice.version, error=describe(e))
                return False
            finally:
                self.synced.set()
        async with self._loaded:
            self.noticed = notice.version
            self._loaded.notify_all()
        return True

    async def _with_newest(self, notice: VersionNotice) -> VersionNotice:
        """`notice` with each model's newest published version, where newer than the notice's."""
        models, manifests = dict(notice.models), dict(notice.manifests)
        incarnations = dict(notice.incarnations)
        for model, msg in (await newest_published(self.bus, list(models))).items():
            if msg.version > models[model]:
                models[model], manifests[model] = msg.version, msg.manifest_key
                if msg.incarnation is not None:
                    incarnations[model] = msg.incarnation
        return dataclasses.replace(notice, models=models, manifests=manifests, incarnations=incarnations)


def _read_notices(stream: str, cursor: str, block_ms: int, client):
    return client.xread({stream: cursor}, count=64, block=block_ms)

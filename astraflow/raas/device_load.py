"""Versions into an engine that takes tensors (`Engine.tensors_device`), without files, on its device.

Per model the loader keeps the engine's version as one flat tensor on the engine's device (the mirror:
what the engine holds, verified), and gets each new version into it the shortest way that reaches:

1. `shared`: the trainer is on this host and shares the version (`weights.share`): mapped (CUDA IPC on a
   GPU, its buffer file on the CPU), copied device to device and checked against the manifest's device
   checksum, with no pull at all;
2. `delta`: the receiver pulled the version's delta (verified by its BLAKE3 digest) and the mirror holds
   its base: the delta is applied on the device (`weights.device.apply_delta`), so only the delta crosses
   to it;
3. `half`: otherwise the receiver's verified half is copied to the device whole.

The engine then copies from the mirror's views into its parameters (paused); no file is opened. Every
step verifies before the engine sees the bytes: a shared copy by its checksum, a delta by its digest
applied to a verified base (the receiver's invariant), a half by the receiver's checks.
"""

from __future__ import annotations

import asyncio
import time

import structlog

from astraflow.engines import Engine
from astraflow.errors import DecodeError, WeightIntegrityError
from astraflow.messages import TensorSpec, WeightManifest
from astraflow.streams import Bus
from astraflow.weights import device, share
from astraflow.weights.share import Reader

log = structlog.get_logger(__name__)


def tensors(flat, specs: list[TensorSpec]) -> dict:
    """Views of each tensor of a flat version, by name (no copy)."""
    import torch

    return {
        s.name: flat[s.offset : s.offset + s.nbytes].view(getattr(torch, s.dtype)).view(s.shape)
        for s in specs
    }


class DeviceLoader:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self._readers: dict[str, Reader] = {}
        self._mirrors: dict[str, tuple[int, str, object]] = {}
        """Model -> (version, manifest digest, flat tensor) the engine holds."""
        self.last: dict[str, str] = {}
        """Model -> the way its last version came (`shared`, `delta`, `half`)."""
        self.pause_s: dict[str, float] = {}
        """Model -> seconds its engine was paused for the last load (pause, copy in, resume)."""

    async def shared(self, model: str, engine: Engine, manifest: WeightManifest) -> bool:
        """Load the version from the trainer's device when it shares it here (way 1); False when it does
        not, or the copy failed its checksum (logged): then pull it (`from_half`)."""
        if engine.tensors_device is None or not manifest.device_checksum:
            return False
        try:
            shared = await share.get(self.bus, model, manifest.version)
            if shared is None:
                return False
            if (shared.version, shared.checksum) != (manifest.version, manifest.device_checksum):
                raise DecodeError("shared version: not the manifest's version")
        except DecodeError as e:
            log.warning("weights_shared_refused", model=model, version=manifest.version, error=str(e))
            return False
        reader = self._readers.setdefault(model, Reader(engine.tensors_device))
        flat = self._spare(model, manifest.nbytes, engine.tensors_device)
        try:
            took = await asyncio.to_thread(reader.take, shared, flat)
        except WeightIntegrityError as e:  # torn by the trainer's next write, or mapped wrong
            log.warning("weights_shared_refused", model=model, version=manifest.version, error=str(e))
            return False
        if took is None:
            return False
        await self._load(model, engine, manifest, flat, "shared")
        return True

    async def from_half(self, model: str, engine: Engine, manifest: WeightManifest, half, delta) -> None:
        """Load the receiver's verified `half` (way 3), or apply `delta` (the verified bytes that made it)
        to the mirror on the device when that holds the delta's base (way 2)."""
        import torch

        held = self._mirrors.get(model)
        if (
            delta is not None
            and held is not None
            and (held[0], held[1])
            == (
                manifest.base_version,
                manifest.base_digest,
            )
        ):
            flat = held[2]
            await asyncio.to_thread(device.apply_delta, flat, delta)
            self._mirrors.pop(model)  # changed in place: no longer the base
            way = "delta"
        else:
            flat = self._spare(model, manifest.nbytes, engine.tensors_device)
            source = torch.frombuffer(half.data, dtype=torch.uint8) if len(half.data) else None
            if source is not None:
                await asyncio.to_thread(flat.copy_, source)
            way = "half"
        await self._load(model, engine, manifest, flat, way)

    def _spare(self, model: str, nbytes: int, where):
        """A flat tensor on the engine's device to build the next version in: the mirror's own storage
        (the engine holds its copy in its parameters; a failed build leaves no mirror)."""
        import torch

        held = self._mirrors.pop(model, None)
        if held is not None and held[2].numel() == nbytes:
            return held[2]
        return torch.empty(nbytes, dtype=torch.uint8, device=where)

    async def _load(self, model: str, engine: Engine, manifest: WeightManifest, flat, way: str) -> None:
        views = tensors(flat, manifest.tensors)
        started = time.perf_counter()
        try:
            await engine.pause()
            await engine.load_tensors(views, manifest.version)
        finally:
            await engine.resume()
        self.pause_s[model] = time.perf_counter() - started
        self._mirrors[model] = (manifest.version, manifest.digest, flat)
        self.last[model] = way

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._mirrors = {}

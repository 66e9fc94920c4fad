"""The publisher's versions on the trainer's device (`weights.build_on`): two flat slots, one served, one
being built.

`snapshot` is all the trainer waits for: each served tensor cast into the idle slot, enqueued on the
trainer's stream (one device-to-device pass; on a CUDA trainer nothing waits on the host). The background
then works on a stream of its own that waits for the snapshot: `check` (the checksum and the NaN/inf
count, on the device, before anything is shared), `land` (the version's bytes into the host buffer half,
which the network path, local copies and checkpoints read; with a served version to compare with, only
the changed elements' indices and bits cross for the delta, `device.changes`) and, after the flip, the
`SharedVersion` record engines on this host map (`weights.share`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import structlog

from astraflow.messages import TensorSpec, WeightFile
from astraflow.weights import device, layout, local, scan
from astraflow.weights.buffer import Half
from astraflow.weights.share import CudaHandle, SharedVersion, export

log = structlog.get_logger(__name__)


def choose(build_on: str, state) -> str | None:
    """The device to build versions on for `weights.build_on` and a state dict: None builds on the host
    (`DoubleBuffer.write_state`). `auto` builds on the device the weights are on when that is CUDA."""
    first = next(iter(state.values()))
    where = first.device
    if build_on == "host" or (build_on == "auto" and where.type != "cuda"):
        return None
    return str(where)


def for_state(state, specs: list[TensorSpec], settings, model: str) -> DeviceVersions | None:
    """The device versions of a publisher of `state` (`WeightsSettings`), None on the host; logged."""
    on = choose(settings.build_on, state)
    log.info("weights_build_path", model=model, on=on or "host", setting=settings.build_on)
    return None if on is None else DeviceVersions(specs, on, settings.dtype)


@dataclass(frozen=True)
class Checked:
    checksum: str
    nonfinite: int


class DeviceVersions:
    def __init__(self, specs: list[TensorSpec], on: str, dtype: str) -> None:
        self.specs, self.on, self.dtype = specs, on, dtype
        self.itemsize = layout.itemsize(specs)
        self.slots = [device.empty(specs, on), device.empty(specs, on)]
        self.served: int | None = None
        """The slot of the served version (None until one is)."""
        self.building = 0
        self._ready = None  # the event after the last snapshot
        self._handles: dict[int, CudaHandle | WeightFile | None] = {}

    @property
    def new(self):
        return self.slots[self.building]

    def snapshot(self, state) -> None:
        """Cast `state` into the idle slot on the trainer's stream (the only part it waits for)."""
        self.building = 1 if self.served == 0 else 0
        device.snapshot(state, self.specs, self.new)
        self._ready = device.mark(self.on)

    async def take(self, state) -> None:
        """`snapshot`: on CUDA enqueued from the caller's thread (no host wait), on the CPU in a thread."""
        if self.on.startswith("cuda"):
            self.snapshot(state)
        else:
            await asyncio.to_thread(self.snapshot, state)

    def check(self) -> Checked:
        """The new version's checksum and count of NaN/inf elements, on the device (blocks this thread)."""
        with device.off_stream(self.on, self._ready):
            bits = device.words(self.new, self.itemsize)
            return Checked(device.checksum(self.new), device.nonfinite(bits, self.dtype))

    def land(self, half: Half, compare: bool) -> scan.Scan:
        """Copy the new version into `half` and describe it as `scan.scan` would: BLAKE3 digests (of the host
        bytes: they cross networks), and with `compare` the changes since the served slot, found on the
        device. NaN/inf were counted by `check`."""
        import torch

        parts = None
        with device.off_stream(self.on, self._ready):
            if compare and self.served is not None:
                found = device.changes(self.new, self.slots[self.served], self.itemsize)
                n = self.new.numel() // self.itemsize
                parts = device.parts(*device.to_host(*found), self.itemsize, n)
            target = torch.frombuffer(half.data, dtype=torch.uint8) if len(half.data) else None
            if target is not None:
                target.copy_(self.new, non_blocking=False)
        whole, chunks = layout.digests(half.data)
        return scan.Scan(whole, chunks, parts, 0)

    def flip(self) -> None:
        self.served = self.building

    def shared(
        self, model: str, version: int, checksum: str, file: WeightFile | None
    ) -> SharedVersion | None:
        """The record of the served slot for engines on this host (None: nothing they could map)."""
        slot = self.served
        assert slot is not None
        if slot not in self._handles or self.slots[slot].device.type != "cuda":
            self._handles[slot] = export(self.slots[slot], file)  # a CUDA slot is exported once
        handle = self._handles[slot]
        if handle is None:
            return None
        cuda = handle if isinstance(handle, CudaHandle) else None
        return SharedVersion(
            model, version, self.slots[slot].numel(), checksum, local.host(), cuda, None if cuda else handle
        )

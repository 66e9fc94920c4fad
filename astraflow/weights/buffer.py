"""A double buffer of served weights: two safetensors files, one served, one being written.

Writers fill the idle half and flip. A half that a transfer (or an engine load) is reading is never
written: readers hold it with `reading`, and `claim` waits until the half it is about to overwrite has
no readers left. That wait is bounded: after `grace_s` the readers that can be cut off (transfers) are,
and a half still held another `grace_s` later raises TransferError rather than blocking its writer
forever. Files are created 0600 (weights are not for other users). Each half lives in its own
directory, so a served half is a loadable checkpoint directory (the caller adds the model's config
files with `add_files`).
"""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from astraflow.errors import ConfigError
from astraflow.messages import TensorSpec
from astraflow.weights import layout
from astraflow.weights.wire import TransferError

WEIGHTS_FILE = "model.safetensors"


def reserve(fd: int, size: int, directory: Path) -> None:
    """Give the file `size` bytes of real storage now (`posix_fallocate`): a buffer in a full `/dev/shm`
    fails here with a clear error instead of SIGBUS at the first write through the mapping."""
    try:
        if size:
            os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        free = shutil.disk_usage(directory).free
        raise ConfigError(
            f"no room for {size / 2**20:.0f} MiB of weights in {directory} ({free / 2**20:.0f} MiB free):"
            " each process holds two buffers per policy (weights.dir; /dev/shm by default: size it as"
            " deploy/README.md says)"
        ) from None


class Half:
    def __init__(self, directory: Path, specs: list[TensorSpec]) -> None:
        self.dir = directory
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.path = directory / WEIGHTS_FILE
        head = layout.header(specs)
        self.data_offset = len(head)
        size = len(head) + layout.data_bytes(specs)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)  # also when the file was there before
        self._file = os.fdopen(fd, "r+b")  # kept open as long as the mapping
        self._file.write(head)
        self._file.flush()
        reserve(fd, size, directory)
        self._map = mmap.mmap(self._file.fileno(), size)
        self.data = memoryview(self._map)[self.data_offset :]
        self.version: int | None = None
        self.readers: dict[object, Callable[[], None] | None] = {}
        """One entry per reader: how to cut it off (None: it cannot be)."""

    def fileno(self) -> int:
        return self._file.fileno()

    def close(self) -> None:
        self.data.release()
        try:
            self._map.close()
        except BufferError:  # a transfer thread still writes into it (stopped mid-pull): unmapped at exit
            return
        self._file.close()


class DoubleBuffer:
    def __init__(self, root: Path, specs: list[TensorSpec], grace_s: float = 10.0) -> None:
        self.root, self.specs, self.grace_s = Path(root), specs, grace_s
        self.itemsize = layout.itemsize(specs)
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._halves = [Half(self.root / "a", specs), Half(self.root / "b", specs)]
        self.served: Half | None = None
        self._cond = threading.Condition()

    @property
    def idle(self) -> Half:
        return self._halves[1] if self.served is self._halves[0] else self._halves[0]

    @property
    def halves(self) -> tuple[Half, Half]:
        return self._halves[0], self._halves[1]

    def add_files(self, files: Mapping[str, Path]) -> None:
        """Copy files (config.json, tokenizer, ...) next to the weights in both halves."""
        for half in self._halves:
            for name, src in files.items():
                shutil.copyfile(src, half.dir / name)

    @contextmanager
    def reading(self, half: Half, cut: Callable[[], None] | None = None) -> Iterator[Half]:
        """Hold `half` for reading: it is not written until released. `cut` makes the holder let go soon
        (a transfer: shut its socket), called when a writer has waited `grace_s` for it."""
        token = object()
        with self._cond:
            half.readers[token] = cut
        try:
            yield half
        finally:
            with self._cond:
                del half.readers[token]
                self._cond.notify_all()

    def claim(self) -> Half:
        """The idle half, to be written, once nobody reads it; its version is unknown until `flip`.
        Readers still there after `grace_s` are cut off; TransferError if any is left `grace_s` after
        that. Blocks: call it off the event loop."""
        half = self.idle
        with self._cond:
            if not self._cond.wait_for(lambda: not half.readers, self.grace_s):
                for cut in [c for c in half.readers.values() if c is not None]:
                    cut()
                if not self._cond.wait_for(lambda: not half.readers, self.grace_s):
                    raise TransferError(f"{len(half.readers)} readers hold {half.dir.name} past the grace")
            half.version = None
        return half

    def flip(self, version: int) -> Half:
        """Serve the idle half as `version`; the previously served half becomes idle."""
        with self._cond:
            half = self.idle
            half.version = version
            self.served = half
            return half

    def write_state(self, state: Mapping) -> Half:
        """Copy a torch state dict into the idle half (call `flip` to serve it). Each tensor is cast to the
        served dtype where it lives (on its device) and then copied: one pass over the host bytes, no
        full-precision host copy. Names the layout left out (tied weights) are not read."""
        import torch

        half = self.claim()
        for spec in self.specs:
            dtype = getattr(torch, spec.dtype)
            count = spec.nbytes // dtype.itemsize
            target = torch.frombuffer(half.data, dtype=dtype, count=count, offset=spec.offset)
            source = state[spec.name].detach()
            if source.device.type != "cpu":
                source = source.to(dtype)  # on the device: half the bytes cross to the host
            target.view(spec.shape).copy_(source)
        return half

    def close(self) -> None:
        for half in self._halves:
            half.close()

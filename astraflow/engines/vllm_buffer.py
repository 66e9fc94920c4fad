"""The weight-transfer engine `astraflow_buffer`, inside each vLLM worker: a version's weights are copied
from the RaaS's verified buffer in shared memory into the model's parameters.

A load names the safetensors files to take (a half of the RaaS's double buffer: one file in `/dev/shm`;
any checkpoint directory's files also work). The worker maps each file (read-only, shared), reads its
header from the mapping, and hands the model's own `load_weights` a view of each tensor's bytes, inside
vLLM's layerwise reload (`start_weight_update` / `finish_weight_update`): that maps Hugging Face names
onto vLLM's fused parameters (qkv, gate-up) and redoes the processing loading ends with (on the CPU the
linear weights are repacked for its GEMM kernels), exactly as the `files` path (`reload_weights`) does,
without vLLM's loader opening a checkpoint. A file stays mapped while the next load names it, so from the
second load of each half on, no file is opened at all: the bytes come from memory the RaaS already
verified. A mapping is renewed when its path names another file (other inode or size) than the one
mapped.

Imported only in vLLM processes: by vLLM's factory when a worker creates the engine, or as the workers'
extension class (`WorkerRegistration`), which registers it.
"""

from __future__ import annotations

import mmap
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from astraflow.engines import vllm_plugin
from astraflow.weights import layout


@dataclass
class BufferInitInfo(WeightTransferInitInfo):
    """RaaS -> worker, once per server: nothing to rendezvous (each load names its files)."""


@dataclass
class BufferUpdateInfo(WeightTransferUpdateInfo):
    # RaaS -> worker, per version
    files: list[str] = field(default_factory=list)
    """Absolute paths of the safetensors files that together hold every weight of the version."""

    def __post_init__(self) -> None:
        if not self.files or not all(isinstance(f, str) and os.path.isabs(f) for f in self.files):
            raise ValueError(f"files must be absolute paths of safetensors files, got {self.files!r}")


class Mapped:
    """One file mapped read-only and shared: it sees what the RaaS writes into it, and costs no copy."""

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            st = os.fstat(fd)
            self.identity = (st.st_dev, st.st_ino, st.st_size)
            self.map = mmap.mmap(fd, 0, prot=mmap.PROT_READ) if st.st_size else None
        finally:
            os.close(fd)  # the mapping keeps the file's pages

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each tensor of the file, a view of the mapping (no copy), its header read from the mapping."""
        if self.map is None:
            raise ValueError("an empty weights file")
        base, specs = layout.read_header(self.map)
        with warnings.catch_warnings():  # read-only on purpose: load_weights only copies out of it
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            for s in specs:
                dtype = getattr(torch, s.dtype)
                count = s.nbytes // dtype.itemsize
                flat = torch.frombuffer(self.map, dtype=dtype, count=count, offset=base + s.offset)
                yield s.name, flat.view(s.shape)

    def close(self) -> None:
        if self.map is None:
            return
        try:
            self.map.close()
        except BufferError:  # a tensor still views it: unmapped when the last one goes
            pass


def identity(path: str) -> tuple[int, int, int]:
    """(device, inode, size) of the file at `path`: a stat, which needs no read permission."""
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size


class BufferTransferEngine(WeightTransferEngine[BufferInitInfo, BufferUpdateInfo]):
    """Loads each version from safetensors files in shared memory, mapped (see the module doc)."""

    init_info_cls = BufferInitInfo
    update_info_cls = BufferUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self._maps: dict[str, Mapped] = {}
        self._last: set[str] = set()
        """Files the previous load named: kept mapped (the other half of the double buffer)."""

    def init_transfer_engine(self, init_info: BufferInitInfo) -> None:
        """Nothing to set up: a load names its files."""

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict) -> None:
        """Load one version (see `receive_weights`). The CPU has no accelerator to synchronize with."""
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type != "cpu":
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: BufferUpdateInfo) -> None:
        """Copy every tensor of the named files into the model, through its `load_weights`."""
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        mapped = [self._mapped(path) for path in update_info.files]
        for stale in set(self._maps) - set(update_info.files) - self._last:
            self._maps.pop(stale).close()
        self._last = set(update_info.files)
        with disable_mtp_completeness_check():  # as vLLM's IPC engine: a load need not hold MTP heads
            self.model.load_weights(t for m in mapped for t in m.tensors())

    def _mapped(self, path: str) -> Mapped:
        held = self._maps.get(path)
        if held is not None and held.identity == identity(path):
            return held
        if held is not None:
            held.close()
        self._maps[path] = Mapped(path)
        return self._maps[path]

    def shutdown(self) -> None:
        for m in self._maps.values():
            m.close()
        self._maps.clear()


class WorkerRegistration:
    """A vLLM workers' extension class with nothing in it: naming it (`--worker-extension-cls`) imports
    this module in every worker before its model loads, which registers the engine where the plugin's
    entry point is not installed (`vllm_plugin.WORKER_EXTENSION`)."""


vllm_plugin.register()

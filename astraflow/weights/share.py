"""A served version shared device to device with engines on the trainer's host.

The publisher keeps its versions in flat device tensors (`weights.device`) and says where each one is in a
record beside the manifest (`Keys.weights_shared`, the manifest's TTL): its version, size, `device.checksum`,
the trainer's boot id, and one handle:

- `cuda`: the CUDA IPC handle of the flat tensor's allocation (`UntypedStorage._share_cuda_`, what
  `torch.multiprocessing` sends, as plain fields: nothing is unpickled) and the GPU's UUID. A process on
  the same host that sees that GPU maps it (`_new_shared_cuda`) and copies out device to device;
- `file`: a version built on the CPU lives in the trainer's buffer file in shared memory (`weights.local`):
  the process maps the file read-only.

Everything after the mapping is shared by both: the reader (`Reader.take`) copies the version into a flat
tensor on its own device and checks the checksum there, so a copy torn by the trainer writing that slot
again, or a handle mapped to the wrong memory, raises WeightIntegrityError (the version then comes the
network way). A record whose handle this process cannot reach (another host, a GPU it does not see, no
CUDA, a file it cannot open) gives None, and says why in the log: the caller takes the network path.
"""

from __future__ import annotations

import mmap
import os
import warnings
from dataclasses import asdict, dataclass

import msgpack
import structlog

from astraflow.errors import DecodeError, WeightIntegrityError
from astraflow.messages import WeightFile
from astraflow.weights import device, local

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class CudaHandle:
    """What `UntypedStorage._share_cuda_` gives (less the device index, which is per process: `gpu` names
    the GPU)."""

    gpu: str
    """The GPU's UUID."""
    handle: bytes
    size: int
    offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    tensor_offset: int
    """Bytes from the storage's start to the version's first byte."""


@dataclass(frozen=True)
class SharedVersion:
    # trainer -> engines on its host, a hash beside the manifest (`Keys.weights_shared`)
    model: str
    version: int
    nbytes: int
    checksum: str
    """`device.checksum` of the version's bytes."""
    host: str
    """The trainer's boot id (`local.host`)."""
    cuda: CudaHandle | None = None
    file: WeightFile | None = None

    def encode(self) -> bytes:
        return msgpack.packb(asdict(self))

    @classmethod
    def decode(cls, data: bytes) -> SharedVersion:
        """The record, every field of its type checked; DecodeError naming the first that is not."""
        try:
            raw = msgpack.unpackb(data)
            cuda, file = raw.pop("cuda"), raw.pop("file")
            out = cls(
                **raw,
                cuda=None if cuda is None else CudaHandle(**cuda),
                file=None if file is None else WeightFile(**file),
            )
        except (TypeError, ValueError, KeyError, AttributeError, msgpack.UnpackException) as e:
            raise DecodeError(f"shared version: {e}") from None
        for obj in (out, out.cuda, out.file):
            if obj is None:
                continue
            for name, kind in obj.__annotations__.items():
                if kind in ("int", "str", "bytes", "bool") and type(getattr(obj, name)).__name__ != kind:
                    raise DecodeError(f"shared version: {name} is no {kind}")
        if (out.cuda is None) == (out.file is None):
            raise DecodeError("shared version: exactly one of cuda and file")
        return out


async def put(bus, record: SharedVersion, ttl_s: int) -> None:
    """Write `record` beside its version's manifest (`Keys.weights_shared`) for `ttl_s` seconds."""
    key = bus.keys.weights_shared(record.model, record.version)
    await bus.call(lambda: bus.redis.set(key, record.encode(), ex=ttl_s))


async def get(bus, model: str, version: int) -> SharedVersion | None:
    """The record of `version`, None when there is none; DecodeError when it is malformed."""
    key = bus.keys.weights_shared(model, version)
    found = await bus.read_only(lambda r: r.get(key))
    return SharedVersion.decode(found) if found else None


def gpu_uuid(index: int) -> str:
    import torch

    return str(torch.cuda.get_device_properties(index).uuid)


def export(flat, file: WeightFile | None = None) -> CudaHandle | WeightFile | None:
    """The handle of a flat version: its CUDA IPC handle on a GPU; on the CPU `file`, the buffer file that
    holds the same bytes (None: nothing to share)."""
    if flat.device.type != "cuda":
        return file
    storage = flat.untyped_storage()
    _, handle, size, offset, counter, counter_offset, event, sync = storage._share_cuda_()
    at = flat.storage_offset() * flat.element_size()
    return CudaHandle(
        gpu_uuid(flat.device.index), handle, size, offset, counter, counter_offset, event, sync, at
    )


class Reader:
    """Takes shared versions into this process's device; keeps each mapping (a CUDA allocation can be
    mapped once per process, and mapping is the slow part)."""

    def __init__(self, target_device) -> None:
        import torch

        self.device = torch.device(target_device)
        self._mapped: dict[tuple, object] = {}

    def source(self, shared: SharedVersion):
        """The flat version where the trainer holds it, mapped here; None (logged) when out of reach."""
        if shared.host != local.host() or not shared.host:
            return self._miss(shared, "another host")
        if shared.cuda is not None:
            return self._cuda(shared)
        return self._file(shared)

    def take(self, shared: SharedVersion, into=None):
        """A verified copy of the version on this reader's device (into `into`, a flat byte tensor, when
        given); None when out of reach; WeightIntegrityError when the copy's checksum differs."""
        import torch

        src = self.source(shared)
        if src is None:
            return None
        if into is None:
            into = torch.empty(shared.nbytes, dtype=torch.uint8, device=self.device)
        into.copy_(src)
        if device.checksum(into) != shared.checksum:
            raise WeightIntegrityError(f"{shared.model} v{shared.version}: shared copy fails its checksum")
        return into

    def _cuda(self, shared: SharedVersion):
        import torch

        h = shared.cuda
        assert h is not None
        if not torch.cuda.is_available():
            return self._miss(shared, "no CUDA here")
        index = next((i for i in range(torch.cuda.device_count()) if gpu_uuid(i) == h.gpu), None)
        if index is None:
            return self._miss(shared, "its GPU is not visible here")
        key = ("cuda", h.handle, h.offset)
        storage = self._mapped.get(key)
        if storage is None:
            torch.cuda._lazy_init()
            storage = torch.UntypedStorage._new_shared_cuda(
                index, h.handle, h.size, h.offset, h.ref_counter_handle, h.ref_counter_offset,
                h.event_handle, h.event_sync_required,
            )  # fmt: skip
            self._mapped[key] = storage
        flat = torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}")
        return flat.set_(storage, h.tensor_offset, (shared.nbytes,))

    def _file(self, shared: SharedVersion):
        import torch

        fd = local.open_file(shared.file)
        if fd is None:
            return self._miss(shared, "its file is not readable here")
        try:
            key = ("file", shared.file.device, shared.file.inode)  # type: ignore[union-attr]
            mapped = self._mapped.get(key)
            if mapped is None or len(mapped) != os.fstat(fd).st_size:
                mapped = self._mapped[key] = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        offset = shared.file.offset  # type: ignore[union-attr]
        if offset + shared.nbytes > len(mapped):
            return self._miss(shared, "its file is shorter than the version")
        with warnings.catch_warnings():  # read-only on purpose: only copied out of
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            return torch.frombuffer(mapped, dtype=torch.uint8, count=shared.nbytes, offset=offset)

    def _miss(self, shared: SharedVersion, why: str) -> None:
        log.info("weights_shared_unreachable", model=shared.model, version=shared.version, reason=why)
        return None

    def close(self) -> None:
        for m in self._mapped.values():
            if isinstance(m, mmap.mmap):
                m.close()
        self._mapped = {}

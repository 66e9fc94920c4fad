"""The shared-version record (`weights.share`): a CUDA handle round-trips as plain fields, a record with
a field of the wrong type or not exactly one handle is refused, and a handle this process cannot reach
(another host, no CUDA here, a GPU it does not see) gives None, so the caller takes the network path."""

import msgpack
import pytest
import torch

from astraflow.errors import DecodeError
from astraflow.weights import local
from astraflow.weights.share import CudaHandle, Reader, SharedVersion

HANDLE = CudaHandle("GPU-0000", b"\x01" * 64, 1 << 20, 0, b"ref", 8, b"\x02" * 64, True, 0)


def record(**over) -> SharedVersion:
    fields = dict(model="policy", version=3, nbytes=1 << 20, checksum="ab" * 16, host=local.host())
    return SharedVersion(**{**fields, "cuda": HANDLE, **over})


def test_a_cuda_record_round_trips():
    r = record()
    assert SharedVersion.decode(r.encode()) == r


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d.update(version="3"),
        lambda d: d["cuda"].update(handle="not bytes"),
        lambda d: d["cuda"].update(size=True),
        lambda d: d.update(cuda=None),  # neither handle
        lambda d: d.update(file={"host": "h", "device": 1, "inode": 2, "path": "/x", "offset": 0}),  # both
        lambda d: d.pop("checksum"),
        lambda d: d.update(extra=1),
    ],
)
def test_a_malformed_record_is_refused(change):
    raw = msgpack.unpackb(record().encode())
    change(raw)
    with pytest.raises(DecodeError):
        SharedVersion.decode(msgpack.packb(raw))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only fallback")
def test_a_cuda_handle_without_cuda_here_is_out_of_reach():
    assert Reader("cpu").take(record()) is None


def test_a_record_from_another_host_is_out_of_reach():
    assert Reader("cpu").take(record(host="another-boot-id")) is None


TAKE_CUDA = """
import sys, torch
from astraflow.weights.share import Reader, SharedVersion
flat = Reader("cuda").take(SharedVersion.decode(bytes.fromhex(sys.argv[1])))
print(flat.cpu().numpy().tobytes().hex())
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_another_process_maps_a_cuda_version_by_ipc_and_checks_it():
    import subprocess
    import sys

    from astraflow.weights import device, share

    flat = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, device="cuda")
    handle = share.export(flat)
    shared = SharedVersion("policy", 1, flat.numel(), device.checksum(flat), local.host(), cuda=handle)
    done = subprocess.run(
        [sys.executable, "-c", TAKE_CUDA, shared.encode().hex()], capture_output=True, text=True, check=True
    )
    assert bytes.fromhex(done.stdout.strip()) == flat.cpu().numpy().tobytes()

"""A version built on the device (`weights.device`), run here on CPU tensors: every function gives the
bytes the host path gives (snapshot as `DoubleBuffer.write_state`, delta as `codec.encode`, patch as
`codec.apply`), and the checksum is the integer fingerprint its doc describes."""

import blake3
import numpy as np
import pytest
import torch

from astraflow.errors import WeightIntegrityError
from astraflow.weights import codec, device, layout
from astraflow.weights.buffer import DoubleBuffer


def state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(64, 24, generator=g)
    return {
        "embed.weight": emb,
        "layer.weight": torch.randn(24, 24, generator=g),
        "norm.weight": torch.ones(24),
        "lm_head.weight": emb,  # tied: left out of the layout
    }


def host_bytes(tmp_path, s: dict, specs) -> bytes:
    buf = DoubleBuffer(tmp_path / "b", specs)
    try:
        return bytes(buf.write_state(s).data)
    finally:
        buf.close()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_snapshot_is_the_served_file_bytes(tmp_path, dtype):
    s = state()
    specs = layout.layout(s, dtype)
    flat = device.empty(specs, "cpu")
    device.snapshot(s, specs, flat)
    assert flat.numpy().tobytes() == host_bytes(tmp_path, s, specs)


def versions(n: int, itemsize: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Two flat versions of `n` elements: about 3% changed by one unit, some sign-of-zero and NaN-bit
    changes (equal as floats, different bits), the first and last element changed."""
    rng = np.random.default_rng(seed)
    kind = np.dtype(f"<u{itemsize}")
    old = rng.integers(0, np.iinfo(kind).max, n, dtype=kind)
    new = old.copy()
    hit = rng.random(n) < 0.03
    new[hit] += kind.type(1)
    new[[0, -1]] ^= kind.type(1 << (8 * itemsize - 1))  # +0.0 <-> -0.0 style: only the sign bit
    return old, new


@pytest.mark.parametrize("itemsize", [2, 4])
def test_delta_of_device_changes_is_the_host_delta(monkeypatch, itemsize):
    monkeypatch.setattr(codec, "CHUNK_ELEMENTS", 1000)  # several stretches, one partly filled
    n = 5_321
    old, new = versions(n, itemsize)
    a, b = torch.from_numpy(new.view(np.uint8).copy()), torch.from_numpy(old.view(np.uint8).copy())
    index, changed, was = device.changes(a, b, itemsize)
    host = device.to_host(index, changed, was)
    got = codec.encode_parts(device.parts(*host, itemsize, n), n, itemsize)
    assert got == codec.encode(old.tobytes(), new.tobytes(), itemsize)
    assert len(index) == np.count_nonzero(old != new)


@pytest.mark.parametrize("itemsize", [2, 4])
def test_apply_on_the_device_writes_what_codec_apply_writes(itemsize):
    old, new = versions(4_099, itemsize, seed=1)
    delta = codec.encode(old.tobytes(), new.tobytes(), itemsize)
    flat = torch.from_numpy(old.view(np.uint8).copy())
    assert device.apply_delta(flat, delta) == np.count_nonzero(old != new)
    target = bytearray(old.tobytes())
    codec.apply(target, delta)
    assert flat.numpy().tobytes() == bytes(target) == new.tobytes()


def test_apply_refuses_a_delta_of_another_size_before_writing():
    old, new = versions(100, 2)
    delta = codec.encode(old.tobytes(), new.tobytes(), 2)
    flat = torch.zeros(202, dtype=torch.uint8)
    with pytest.raises(WeightIntegrityError):
        device.apply_delta(flat, delta)
    assert not flat.any()


def reference_checksum(data: bytes) -> str:
    """The module doc's definition in plain numpy: per chunk, the sum and the position-weighted sum of
    its little-endian 16-bit words."""
    w = np.frombuffer(data, "<u2").astype(np.int64)
    rows = []
    for at in range(0, len(w), device.CHECK_WORDS):
        chunk = w[at : at + device.CHECK_WORDS]
        weights = np.arange(len(chunk)) % device.WEIGHT_MOD + 1
        rows.append((chunk.sum(), (chunk * weights).sum()))
    table = np.array(rows, "<i8").reshape(-1, 2)
    return blake3.blake3(np.array([len(data)], "<i8").tobytes() + table.tobytes()).hexdigest(16)


def test_checksum_is_the_documented_fingerprint(monkeypatch):
    monkeypatch.setattr(device, "CHECK_WORDS", 1000)  # many chunks, slabs and a short tail
    monkeypatch.setattr(device, "CHECK_SLAB", 3)
    old, _ = versions(10_501, 2)
    flat = torch.from_numpy(old.view(np.uint8).copy())
    assert device.checksum(flat) == reference_checksum(old.tobytes())


def test_checksum_sees_one_changed_bit_and_two_swapped_words():
    old, _ = versions(3_000, 2)
    base = device.checksum(torch.from_numpy(old.view(np.uint8).copy()))
    flipped = old.copy()
    flipped[1234] ^= 1
    swapped = old.copy()
    swapped[[10, 11]] = swapped[[11, 10]]
    assert old[10] != old[11]
    for other in (flipped, swapped):
        assert device.checksum(torch.from_numpy(other.view(np.uint8).copy())) != base


def test_nonfinite_counts_nan_and_inf_bits():
    values = torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), 0.0], dtype=torch.bfloat16)
    assert device.nonfinite(values.view(torch.int16), "bfloat16") == 3
    assert device.nonfinite(values.float().view(torch.int32), "float32") == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_every_function_gives_the_host_paths_bytes():
    n = 3 * device.CHECK_WORDS + 17
    old, new = versions(n, 2, seed=2)
    a = torch.from_numpy(new.view(np.uint8).copy()).cuda()
    b = torch.from_numpy(old.view(np.uint8).copy()).cuda()
    assert device.checksum(a) == reference_checksum(new.tobytes())
    host = device.to_host(*device.changes(a, b, 2))
    delta = codec.encode(old.tobytes(), new.tobytes(), 2)
    assert codec.encode_parts(device.parts(*host, 2, n), n, 2) == delta
    device.apply_delta(b, delta)
    assert torch.equal(a, b)

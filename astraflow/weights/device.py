"""A version built where the trainer's weights live: snapshot, compare, pack, checksum and apply as torch
ops on the weights' own device (CUDA on a GPU trainer; on the CPU the same ops run on host tensors).

A version is one flat byte tensor laid out as `layout` lays out the served file (state-dict order,
contiguous, the served dtype), so every function here agrees with the host path byte for byte:

- `snapshot` casts each tensor into its slice of the flat buffer: one pass on the device, enqueued on the
  current stream (the next step's kernels queue behind it, so nothing waits on the host);
- `changes` compares two versions as integers of the served dtype's width (bit patterns: -0.0 and 0.0, or
  two NaNs, differ when their bits do) and gathers the changed elements' indices and old and new bits;
  only these leave the device (`to_host`, off the current stream into pinned memory on CUDA), and
  `parts` turns them into the `codec.Part`s whose `codec.encode_parts` is the same delta `codec.encode`
  makes from the two host buffers;
- `apply` patches a flat version on its device with a decoded delta (`codec.decode`), with the same
  wrap-around arithmetic as `codec.apply`;
- `checksum` is an exact integer fingerprint computed on the device: per chunk of `CHECK_WORDS` 16-bit
  words, their sum and their sum weighted by position, copied out (16 bytes per 2 MiB) and hashed with
  BLAKE3. Integer sums do not depend on the order of the additions, so CPU and CUDA give the same value.
  It detects a changed element, a torn copy or a wrong mapping; it is no defence against a forger (bytes
  that cross a network are checked with BLAKE3, `layout.digests`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping

import blake3
import numpy as np

from astraflow.messages import TensorSpec
from astraflow.weights import codec, layout

CHECK_WORDS = 1 << 20
"""16-bit words per checksum chunk (2 MiB): the weighted sum of a chunk stays below 2^52."""
CHECK_SLAB = 16
"""Chunks summed at a time (bounds the int32 temporary: 64 MiB)."""
WEIGHT_MOD = 32749
"""Position weights run 1..WEIGHT_MOD (a prime below 2^15: a word times its weight fits an int32)."""
INT = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}


def _torch():
    import torch

    return torch


def empty(specs: list[TensorSpec], device) -> object:
    """A flat byte tensor on `device` that holds a version of the layout `specs`."""
    return _torch().empty(layout.data_bytes(specs), dtype=_torch().uint8, device=device)


def snapshot(state: Mapping, specs: list[TensorSpec], out) -> None:
    """Copy `state` into the flat version `out`, each tensor cast to its served dtype on the way, on the
    current stream of `out`'s device (asynchronous on CUDA: the copy is ordered before whatever the
    trainer enqueues next, so its next step cannot overwrite what is still being read). Names the layout
    left out (tied weights) are not read. A tensor on another device than `out` crosses once, cast."""
    torch = _torch()
    for spec in specs:
        dtype = getattr(torch, spec.dtype)
        target = out[spec.offset : spec.offset + spec.nbytes].view(dtype).view(spec.shape)
        target.copy_(state[spec.name].detach(), non_blocking=True)


def words(flat, itemsize: int):
    """`flat` (bytes) as signed integers of `itemsize` bytes: the bit patterns compared."""
    return flat.view(getattr(_torch(), INT[itemsize]))


def changes(new, old, itemsize: int):
    """(indices int64, new bits, old bits) of the elements where two flat versions differ, on their
    device, indices sorted."""
    torch = _torch()
    a, b = words(new, itemsize), words(old, itemsize)
    if a.shape != b.shape:
        raise ValueError(f"versions differ in length: {new.numel()} and {old.numel()} bytes")
    index = torch.nonzero(a != b).flatten()
    return index, a[index], b[index]


def to_host(*tensors) -> list[np.ndarray]:
    """Copies of device tensors in host memory as numpy arrays, on the current stream (call it within
    `off_stream`): on CUDA through pinned memory, then that stream alone is synchronised."""
    torch = _torch()
    if not tensors or tensors[0].device.type == "cpu":
        return [t.numpy().copy() for t in tensors]
    out = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for host, t in zip(out, tensors, strict=True):
        host.copy_(t, non_blocking=True)
    torch.cuda.current_stream(tensors[0].device).synchronize()
    return [h.numpy() for h in out]


def mark(device) -> object | None:
    """An event recorded on `device`'s current stream (None on the CPU): what `off_stream` waits for."""
    torch = _torch()
    if torch.device(device).type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


@contextlib.contextmanager
def off_stream(device, after=None):
    """Run the enclosed work on a stream of its own on `device` (CUDA; the CPU has none), which first
    waits for `after` (`mark`'s event): the trainer's stream is never synchronised by it."""
    torch = _torch()
    if torch.device(device).type != "cuda":
        yield
        return
    side = _side_stream(torch.device(device))
    if after is not None:
        side.wait_event(after)
    with torch.cuda.stream(side):
        yield


@functools.cache
def _side_stream(device):
    return _torch().cuda.Stream(device)


def parts(index: np.ndarray, new: np.ndarray, old: np.ndarray, itemsize: int, n: int) -> list[codec.Part]:
    """The `codec.Part`s (one per `codec.CHUNK_ELEMENTS` stretch that changed) of host copies of
    `changes`' output, for a version of `n` elements: `codec.encode_parts(parts, n, itemsize)` is the
    delta `codec.encode` makes of the two versions' bytes."""
    kind = np.dtype(f"<u{itemsize}")
    new, old = new.view(kind), old.view(kind)
    starts = np.arange(0, n, codec.CHUNK_ELEMENTS, dtype=np.int64)
    bounds = np.searchsorted(index, np.append(starts, n))
    out = []
    for i, start in enumerate(starts):
        lo, hi = bounds[i], bounds[i + 1]
        if hi > lo:
            out.append(codec.Part.of(int(start), index[lo:hi] - start, new[lo:hi], old[lo:hi]))
    return out


def apply(flat, index, diffs, itemsize: int) -> None:
    """Add `diffs` (unsigned differences, as `codec.decode` gives them) at `index` of the flat version
    `flat`, modulo 2^bits, on `flat`'s device: the same bytes `codec.apply` writes."""
    torch = _torch()
    kind = getattr(torch, INT[itemsize])
    device = flat.device
    where = torch.from_numpy(np.ascontiguousarray(index, np.int64)).to(device, non_blocking=True)
    add = torch.from_numpy(np.ascontiguousarray(diffs).view(INT[itemsize])).to(device, non_blocking=True)
    view = words(flat, itemsize)
    view.index_put_((where,), view[where] + add.to(kind))  # integer addition wraps, as unsigned does


def apply_delta(flat, delta: bytes) -> int:
    """Decode an encoded delta on the host and apply it to the flat version `flat` on its device;
    WeightIntegrityError for a malformed delta or one of another size, before any write. Returns the
    number of changed elements."""
    from astraflow.errors import WeightIntegrityError

    index, diffs = codec.decode(delta)
    itemsize = diffs.dtype.itemsize
    n = codec.HEADER.unpack_from(memoryview(delta).cast("B"))[3]
    if n * itemsize != flat.numel():
        raise WeightIntegrityError(f"delta is for {n} elements, the version holds {flat.numel() // itemsize}")
    apply(flat, index, diffs, itemsize)
    return len(index)


def nonfinite(values, dtype: str) -> int:
    """How many of `values` (bits of the served dtype, on any device) are NaN or inf."""
    from astraflow.weights.scan import EXPONENT

    torch = _torch()
    exponent = EXPONENT[dtype]
    if exponent >= 1 << (8 * values.element_size() - 1):  # (the sign bit: as the signed type's value)
        exponent -= 1 << (8 * values.element_size())
    mask = torch.tensor(exponent, dtype=values.dtype, device=values.device)
    return int(((values & mask) == mask).sum())


def checksum(flat) -> str:
    """The version's fingerprint (hex, `layout.DIGEST_BYTES` long), computed on `flat`'s device: see the
    module doc. Equal for equal bytes on any device; an odd number of bytes is refused."""
    torch = _torch()
    if flat.numel() % 2:
        raise ValueError(f"a version of {flat.numel()} bytes is no whole number of 16-bit words")
    w = flat.view(torch.int16)
    weights = _weights(w.device, CHECK_WORDS)
    sums = []
    step = CHECK_WORDS * CHECK_SLAB
    for at in range(0, w.numel(), step):
        slab = w[at : at + step].to(torch.int32) & 0xFFFF
        whole = slab.numel() // CHECK_WORDS * CHECK_WORDS
        rows = [slab[:whole].view(-1, CHECK_WORDS)] if whole else []
        for row in rows:
            sums.append(
                torch.stack([row.sum(1, dtype=torch.int64), (row * weights).sum(1, dtype=torch.int64)], 1)
            )
        if whole < slab.numel():
            tail = slab[whole:]
            weighted = (tail * weights[: tail.numel()]).sum(dtype=torch.int64)
            sums.append(torch.stack([tail.sum(dtype=torch.int64), weighted]).view(1, 2))
    table = torch.cat(sums).cpu().numpy() if sums else np.empty((0, 2), np.int64)
    head = np.array([flat.numel()], "<i8").tobytes()
    return blake3.blake3(head + table.astype("<i8").tobytes()).hexdigest(layout.DIGEST_BYTES)


@functools.cache
def _weights(device, n: int):
    torch = _torch()
    return (torch.arange(n, dtype=torch.int32, device=device) % WEIGHT_MOD) + 1

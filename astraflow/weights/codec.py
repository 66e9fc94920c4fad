"""Sparse weight deltas: the elements that changed between two versions of a flat weight buffer.

Elements are compared bit for bit as unsigned integers of the served dtype's width (bf16 -> uint16), so
a delta reproduces the new bytes exactly. Layout of an encoded delta:

    magic b"AFD1" | itemsize u8 | pad 3 | n_elements u64 | n_changed u64 | gap_bytes u64
    | gaps: LEB128 varints, gap_i = index_i - index_{i-1} - 1 (index_{-1} = -1)
    | values: the new elements at the changed indices, little-endian

With 1% of bf16 elements changed at random, gaps are mostly one byte: ~3.3 bytes per change against 200
bytes of full buffer per change, about 60x smaller. Encoding and decoding are vectorised numpy; the
publisher finds the changed elements in parallel (`scan`).
"""

from __future__ import annotations

import struct

import numpy as np

from astraflow.errors import WeightIntegrityError

MAGIC = b"AFD1"
HEADER = struct.Struct("<4sB3xQQQ")
CHUNK_ELEMENTS = 1 << 26
"""Elements compared at a time (bounds the temporary memory of a diff)."""
MAX_VARINT = 10


def _view(buf, itemsize: int) -> np.ndarray:
    if itemsize not in (1, 2, 4, 8):
        raise ValueError(f"unsupported element size {itemsize}")
    return np.frombuffer(buf, dtype=np.dtype(f"<u{itemsize}"))


def changed_indices(old, new, itemsize: int) -> np.ndarray:
    """Sorted indices of the elements that differ between two equally long buffers."""
    a, b = _view(old, itemsize), _view(new, itemsize)
    if a.shape != b.shape:
        raise ValueError(f"buffers differ in length: {a.nbytes} and {b.nbytes} bytes")
    parts = [
        np.flatnonzero(a[i : i + CHUNK_ELEMENTS] != b[i : i + CHUNK_ELEMENTS]) + i
        for i in range(0, len(a), CHUNK_ELEMENTS)
    ]
    return np.concatenate(parts).astype(np.uint64) if parts else np.empty(0, np.uint64)


def encode(old, new, itemsize: int) -> bytes:
    """The delta that turns `old` into `new` (bytes-like objects of equal length)."""
    return encode_changes(new, changed_indices(old, new, itemsize), itemsize)


def encode_changes(new, index: np.ndarray, itemsize: int) -> bytes:
    """The delta that writes `new`'s elements at the sorted indices `index` (the elements that changed,
    e.g. from `scan.scan`)."""
    values = _view(new, itemsize)[index.astype(np.int64)]
    gaps = np.diff(index.astype(np.int64), prepend=-1) - 1 if len(index) else np.empty(0, np.int64)
    varints = varint_encode(gaps.astype(np.uint64))
    n = len(_view(new, itemsize))
    header = HEADER.pack(MAGIC, itemsize, n, len(index), len(varints))
    return b"".join([header, varints, values.astype(f"<u{itemsize}").tobytes()])


def apply(target, delta) -> int:
    """Write the delta's new values into `target` (a writable buffer holding the base); returns the number
    of changed elements. A delta that does not fit `target` raises WeightIntegrityError before any write."""
    index, values = decode(delta)
    itemsize = values.dtype.itemsize
    view = np.frombuffer(target, dtype=np.dtype(f"<u{itemsize}"))
    n = int(struct.unpack_from("<Q", delta, 8)[0])
    if len(view) != n:
        raise WeightIntegrityError(f"delta is for {n} elements, the buffer holds {len(view)}")
    view[index] = values
    return len(index)


def decode(delta) -> tuple[np.ndarray, np.ndarray]:
    """(changed indices as int64, new values) of an encoded delta; WeightIntegrityError if malformed."""
    delta = memoryview(delta).cast("B")
    if len(delta) < HEADER.size:
        raise WeightIntegrityError(f"delta of {len(delta)} bytes is shorter than its header")
    magic, itemsize, n, count, gap_bytes = HEADER.unpack_from(delta)
    if magic != MAGIC or itemsize not in (1, 2, 4, 8):
        raise WeightIntegrityError("not a delta (bad magic or element size)")
    if len(delta) != HEADER.size + gap_bytes + count * itemsize:
        raise WeightIntegrityError(f"delta size {len(delta)} does not match its header")
    raw = np.frombuffer(delta, np.uint8, gap_bytes, HEADER.size)
    gaps = varint_decode(raw, count)
    index = np.cumsum(gaps.astype(np.int64) + 1) - 1
    if count and (index[-1] >= n or index[0] < 0):
        raise WeightIntegrityError(f"delta index {int(index[-1])} out of range for {n} elements")
    values = np.frombuffer(delta, np.dtype(f"<u{itemsize}"), count, HEADER.size + gap_bytes)
    return index, values


def varint_encode(values: np.ndarray) -> bytes:
    """LEB128 of each uint64, concatenated."""
    values = values.astype(np.uint64)
    lengths = np.ones(len(values), np.int64)
    for k in range(1, MAX_VARINT):
        lengths += values >= np.uint64(1) << np.uint64(7 * k)
    out = np.empty(int(lengths.sum()), np.uint8)
    starts = np.cumsum(lengths) - lengths
    for k in range(int(lengths.max()) if len(values) else 0):
        sel = lengths > k
        low = (values[sel] >> np.uint64(7 * k)) & np.uint64(0x7F)
        more = (lengths[sel] > k + 1).astype(np.uint64) << np.uint64(7)
        out[starts[sel] + k] = (low | more).astype(np.uint8)
    return out.tobytes()


def varint_decode(raw: np.ndarray, count: int) -> np.ndarray:
    """`count` uint64 values from LEB128 bytes that hold exactly that many."""
    ends = np.flatnonzero(raw < 0x80)
    if len(ends) != count or (count and ends[-1] != len(raw) - 1):
        raise WeightIntegrityError(f"delta index bytes hold {len(ends)} values, expected {count}")
    starts = np.empty(count, np.int64)
    if count:
        starts[0] = 0
        starts[1:] = ends[:-1] + 1
    lengths = ends - starts + 1
    if count and lengths.max() > MAX_VARINT:
        raise WeightIntegrityError("delta index bytes hold an overlong value")
    values = np.zeros(count, np.uint64)
    for k in range(int(lengths.max()) if count else 0):
        sel = lengths > k
        values[sel] |= (raw[starts[sel] + k] & 0x7F).astype(np.uint64) << np.uint64(7 * k)
    return values

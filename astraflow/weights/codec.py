"""Sparse weight deltas: the elements that changed between two versions of a flat weight buffer.

Elements are compared bit for bit as unsigned integers of the served dtype's width (bf16 -> uint16), so
a delta reproduces the new bytes exactly. What is stored per changed element is its gap from the one
before (`index_i - index_{i-1} - 1`) and the difference of its bits from the base's (new - old modulo
2^bits, zigzag-coded): a small optimizer step moves most elements by one unit in the last place, so the
difference is almost always 1 or -1. Both go as byte planes (every first byte, then every second, ...),
and the planes through zstd: a plane of equal bytes costs nothing, a plane of gaps about a byte per
element (the gap width is the fewest bytes that hold the largest gap). Layout of an encoded delta:

    magic b"AFD2" | itemsize u8 | gap width u8 | pad 2 | n_elements u64 | n_changed u64
    | zstd frame of: gap planes (gap width bytes each) | difference planes (itemsize bytes each)

Measured (tests/bench/weight_path.py): a real AdamW step at lr 1e-6 on a 0.5B shape changes ~2.4% of the
bf16 elements and its delta is ~1.25 bytes per change, about 70x smaller than the buffer. Applying needs
the base: `apply` adds the differences to the elements it holds.
"""

from __future__ import annotations

import struct

import numpy as np

from astraflow.errors import WeightIntegrityError

MAGIC = b"AFD2"
HEADER = struct.Struct("<4sBB2xQQ")
CHUNK_ELEMENTS = 1 << 26
"""Elements compared at a time by `changed_indices` (bounds the temporary memory of a diff)."""
ZSTD_LEVEL = 1
"""Fast: a delta is made and read once per version, on the critical path of a sync."""


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
    return np.concatenate(parts) if parts else np.empty(0, np.int64)


def encode(old, new, itemsize: int) -> bytes:
    """The delta that turns `old` into `new` (bytes-like objects of equal length)."""
    return encode_changes(old, new, changed_indices(old, new, itemsize), itemsize)


def encode_changes(old, new, index: np.ndarray, itemsize: int) -> bytes:
    """The delta that turns `old` into `new`, whose elements differ exactly at the sorted `index` (e.g.
    from `scan.scan`)."""
    import zstandard

    a, b = _view(old, itemsize), _view(new, itemsize)
    index = index.astype(np.int64)
    gaps = np.diff(index, prepend=-1) - 1
    gap_width = next(w for w in (1, 2, 4, 8) if not len(gaps) or int(gaps.max()) < 1 << (8 * w))
    diffs = _zigzag(b[index] - a[index], itemsize)  # modulo 2^bits: unsigned arithmetic wraps
    planes = np.concatenate([_planes(gaps.astype(f"<u{gap_width}")), _planes(diffs)])
    body = zstandard.ZstdCompressor(level=ZSTD_LEVEL, threads=-1).compress(planes.tobytes())
    return HEADER.pack(MAGIC, itemsize, gap_width, len(b), len(index)) + body


def apply(target, delta) -> int:
    """Turn `target` (a writable buffer holding the base) into the new version; returns the number of
    changed elements. A delta that does not fit `target` raises WeightIntegrityError before any write."""
    index, diffs = decode(delta)
    itemsize = diffs.dtype.itemsize
    view = np.frombuffer(target, dtype=np.dtype(f"<u{itemsize}"))
    n = int(struct.unpack_from("<Q", delta, 8)[0])
    if len(view) != n:
        raise WeightIntegrityError(f"delta is for {n} elements, the buffer holds {len(view)}")
    view[index] = view[index] + diffs
    return len(index)


def decode(delta) -> tuple[np.ndarray, np.ndarray]:
    """(changed indices as int64, differences to add, unsigned) of an encoded delta; WeightIntegrityError
    if malformed."""
    import zstandard

    delta = memoryview(delta).cast("B")
    if len(delta) < HEADER.size:
        raise WeightIntegrityError(f"delta of {len(delta)} bytes is shorter than its header")
    magic, itemsize, gap_width, n, count = HEADER.unpack_from(delta)
    if magic != MAGIC or itemsize not in (1, 2, 4, 8) or gap_width not in (1, 2, 4, 8):
        raise WeightIntegrityError("not a delta (bad magic or element size)")
    if count > n:
        raise WeightIntegrityError(f"delta changes {count} of {n} elements")
    size, frame = count * (gap_width + itemsize), delta[HEADER.size :]
    try:  # bounded: a frame that claims more than its header says is refused, not inflated
        claimed = zstandard.frame_content_size(frame)
        if claimed != size:
            raise WeightIntegrityError(f"delta body claims {claimed} bytes, its header says {size}")
        raw = zstandard.ZstdDecompressor().decompress(frame, max_output_size=size)
    except zstandard.ZstdError as e:
        raise WeightIntegrityError(f"delta body: {e}") from None
    if len(raw) != size:
        raise WeightIntegrityError(f"delta body holds {len(raw)} bytes, its header says {size}")
    body = np.frombuffer(raw, np.uint8)
    gaps = _unplanes(body[: count * gap_width], gap_width).astype(np.int64)
    diffs = _unzigzag(_unplanes(body[count * gap_width :], itemsize), itemsize)
    index = np.cumsum(gaps + 1) - 1
    if count and (index[-1] >= n or gaps.min() < 0):
        raise WeightIntegrityError(f"delta index out of range for {n} elements")
    return index, diffs


def _planes(values: np.ndarray) -> np.ndarray:
    """The bytes of `values` (little-endian) as planes: every element's first byte, then second, ..."""
    return values.view(np.uint8).reshape(-1, values.dtype.itemsize).T.ravel()


def _unplanes(planes: np.ndarray, width: int) -> np.ndarray:
    return np.ascontiguousarray(planes.reshape(width, -1).T).view(f"<u{width}").ravel()


def _zigzag(diffs: np.ndarray, itemsize: int) -> np.ndarray:
    """Unsigned differences as zigzag (0, -1, 1, -2, ... -> 0, 1, 2, 3, ...): small either way."""
    bits = 8 * itemsize
    signed = diffs.view(f"<i{itemsize}")
    return ((signed << 1) ^ (signed >> (bits - 1))).view(f"<u{itemsize}")


def _unzigzag(z: np.ndarray, itemsize: int) -> np.ndarray:
    one = z.dtype.type(1)
    return (z >> one) ^ (-(z & one).view(f"<i{itemsize}")).view(f"<u{itemsize}")

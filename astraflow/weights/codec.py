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

A delta is made in stretches (`Part`): each stretch of the buffer is compared, and its gaps and
differences computed, on its own (in the publisher's scan, in parallel threads, while the stretch is in
cache); `encode_parts` only joins them into planes and compresses. Applying decodes and patches the
changes in blocks, in parallel threads, after copying the base (when one is given) in the same threads
while the body is decompressed.

Measured (tests/bench/weight_path.py): a real AdamW step at lr 1e-6 on a 0.5B shape changes ~2.4% of the
bf16 elements and its delta is ~1.4 bytes per change, about 60x smaller than the buffer.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from astraflow.errors import WeightIntegrityError
from astraflow.weights import layout

MAGIC = b"AFD2"
HEADER = struct.Struct("<4sBB2xQQ")
CHUNK_ELEMENTS = 1 << 21
"""Elements compared at a time (bounds a diff's temporary memory; a stretch in cache)."""
BLOCK = 1 << 18
"""Changes decoded and patched at a time. Every array of a block stays under 4 MiB, the size from which
numpy asks for transparent huge pages: their first touch can stall in the kernel's memory compaction
(measured: most of a delta's decode time, in a process that had trained a step)."""
ZSTD_LEVEL = 1
"""Fast: a delta is made and read once per version, on the critical path of a sync."""
WORD = np.dtype("<u8")


def _view(buf, itemsize: int) -> np.ndarray:
    if itemsize not in (1, 2, 4, 8):
        raise ValueError(f"unsupported element size {itemsize}")
    return np.frombuffer(buf, dtype=np.dtype(f"<u{itemsize}"))


def compare(new: np.ndarray, old: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sorted indices, new elements, old elements) where two equally long arrays of unsigned elements
    differ. Compared a 64-bit word at a time (4 bf16 per comparison); only the words that differ are
    split into their elements, and a tail shorter than a word is compared element by element."""
    lanes = WORD.itemsize // new.itemsize
    shift = lanes.bit_length() - 1
    whole = len(new) - len(new) % lanes
    a, b = new[:whole].view(WORD), old[:whole].view(WORD)
    words = np.flatnonzero(a != b)
    xs, ys = a.take(words).view(new.dtype), b.take(words).view(new.dtype)  # the differing words' elements
    k = np.flatnonzero(xs != ys)
    index = (words[k >> shift] << shift) + (k & (lanes - 1))
    xs, ys = xs[k], ys[k]
    if whole < len(new):
        tail = np.flatnonzero(new[whole:] != old[whole:]) + whole
        index = np.concatenate([index, tail])
        xs, ys = np.concatenate([xs, new[tail]]), np.concatenate([ys, old[tail]])
    return index, xs, ys


@dataclass(frozen=True)
class Part:
    """The changes within one stretch of a buffer (fewer than 2^32 elements) starting at element `start`:
    gaps (the first one counted from `start`, as if the element before it had changed) and zigzag-coded
    differences."""

    start: int
    gaps: np.ndarray
    diffs: np.ndarray
    last: int
    """Index (in the whole buffer) of the stretch's last change; -1 when none."""
    widest: int
    """The largest gap after the first (0 when none)."""

    @classmethod
    def of(cls, start: int, index: np.ndarray, new: np.ndarray, old: np.ndarray) -> Part:
        """From `compare`'s output for the stretch at `start` (indices relative to it)."""
        gaps = np.empty(len(index), "<u4")
        gaps[:1] = index[:1]  # the first: `index[0] - (-1) - 1`, counted from `start`
        np.subtract(index[1:], index[:-1], out=gaps[1:], casting="unsafe")
        gaps[1:] -= 1
        diffs = _zigzag(new - old, new.itemsize)  # modulo 2^bits: unsigned arithmetic wraps
        widest = int(gaps[1:].max()) if len(gaps) > 1 else 0
        return cls(start, gaps, diffs, start + int(index[-1]) if len(index) else -1, widest)


def _stretches(old, new, itemsize: int):
    """(start, new stretch, old stretch) of two equally long buffers, `CHUNK_ELEMENTS` at a time."""
    a, b = _view(old, itemsize), _view(new, itemsize)
    if a.shape != b.shape:
        raise ValueError(f"buffers differ in length: {a.nbytes} and {b.nbytes} bytes")
    return [(s, b[s : s + CHUNK_ELEMENTS], a[s : s + CHUNK_ELEMENTS]) for s in _starts(len(a))]


def changed_indices(old, new, itemsize: int) -> np.ndarray:
    """Sorted indices of the elements that differ between two equally long buffers."""
    found = [compare(x, y)[0] + s for s, x, y in _stretches(old, new, itemsize)]
    return np.concatenate(found) if found else np.empty(0, np.int64)


def encode(old, new, itemsize: int) -> bytes:
    """The delta that turns `old` into `new` (bytes-like objects of equal length)."""
    found = [Part.of(s, *compare(x, y)) for s, x, y in _stretches(old, new, itemsize)]
    return encode_parts(found, len(_view(new, itemsize)), itemsize)


def encode_parts(found: list[Part], n: int, itemsize: int) -> bytes:
    """The delta of a buffer of `n` elements whose changes are `found`, in order of `start`."""
    import zstandard

    found = [p for p in found if len(p.gaps)]
    firsts, last = [], -1  # each stretch's first gap, counted from the change before it
    for p in found:
        firsts.append(p.start + int(p.gaps[0]) - last - 1)
        last = p.last
    widest = max([0, *firsts, *(p.widest for p in found)])
    gap_width = next(w for w in (1, 2, 4, 8) if widest < 1 << (8 * w))
    count = sum(len(p.gaps) for p in found)
    planes = np.frombuffer(bytearray((gap_width + itemsize) * count), np.uint8)  # (no huge pages: see BLOCK)
    gap_planes = planes[: gap_width * count].reshape(gap_width, count)
    diff_planes = planes[gap_width * count :].reshape(itemsize, count)
    offsets = np.cumsum([0, *(len(p.gaps) for p in found)])

    def fill(i: int) -> None:
        p, at, to = found[i], offsets[i], offsets[i + 1]
        low = min(gap_width, 4)
        gap_planes[:low, at:to] = p.gaps.view(np.uint8).reshape(-1, 4).T[:low]
        gap_planes[low:, at:to] = 0
        gap_planes[:, at] = np.frombuffer(struct.pack("<Q", firsts[i]), np.uint8)[:gap_width]
        diff_planes[:, at:to] = p.diffs.view(np.uint8).reshape(-1, itemsize).T

    list(layout.hash_pool().map(fill, range(len(found))))
    body = zstandard.ZstdCompressor(level=ZSTD_LEVEL, threads=-1).compress(planes)
    return HEADER.pack(MAGIC, itemsize, gap_width, n, count) + body


def apply(target, delta, base=None) -> int:
    """Turn `target` (a writable buffer holding the base) into the new version; returns the number of
    changed elements. A delta that does not fit `target` raises WeightIntegrityError before any write.

    With `base` (a buffer as long as `target`), `target` may hold anything: it is made a copy of `base`
    (in the hash pool's threads, while the delta is decompressed), also when the delta is refused. The
    changes are then decoded and patched block by block in parallel threads."""
    pool = layout.hash_pool()
    data = np.frombuffer(target, np.uint8)
    copies = []
    if base is not None:
        source = np.frombuffer(base, np.uint8)
        if len(source) != len(data):
            raise ValueError(f"base holds {len(source)} bytes, the target {len(data)}")
        step = layout.CHUNK_BYTES
        starts = range(0, len(data), step)
        copies = [pool.submit(np.copyto, data[s : s + step], source[s : s + step]) for s in starts]
    try:
        n, itemsize, blocks = _blocks(delta)
    finally:
        for c in copies:  # done before any other write (or a refusal) reaches `target`
            c.result()
    if len(data) != n * itemsize:
        raise WeightIntegrityError(f"delta is for {n} elements, the buffer holds {len(data) // itemsize}")
    view = data.view(f"<u{itemsize}")

    def patch(block: tuple[np.ndarray, np.ndarray]) -> None:
        where, diffs = block
        view[where] += diffs  # each index once: a plain gather, add and scatter

    list(pool.map(patch, blocks))
    return sum(len(b[0]) for b in blocks)


def decode(delta) -> tuple[np.ndarray, np.ndarray]:
    """(changed indices as int64, differences to add, unsigned) of an encoded delta; WeightIntegrityError
    if malformed."""
    _, itemsize, blocks = _blocks(delta)
    if not blocks:
        return np.empty(0, np.int64), np.empty(0, f"<u{itemsize}")
    return np.concatenate([b[0] for b in blocks]), np.concatenate([b[1] for b in blocks])


def _blocks(delta) -> tuple[int, int, list[tuple[np.ndarray, np.ndarray]]]:
    """(elements, item size, [(indices, differences)] of `BLOCK` changes each, in order) of a delta, all
    checked; decoded in the hash pool's threads."""
    import zstandard

    delta = memoryview(delta).cast("B")
    if len(delta) < HEADER.size:
        raise WeightIntegrityError(f"delta of {len(delta)} bytes is shorter than its header")
    magic, itemsize, gap_width, n, count = HEADER.unpack_from(delta)
    if magic != MAGIC or itemsize not in (1, 2, 4, 8) or gap_width not in (1, 2, 4, 8):
        raise WeightIntegrityError("not a delta (bad magic or element size)")
    if count > n or n >= 1 << 62:
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
    gap_planes = body[: count * gap_width].reshape(gap_width, count)
    diff_planes = body[count * gap_width :].reshape(itemsize, count)
    out_of_range = WeightIntegrityError(f"delta index out of range for {n} elements")

    def one(at: int) -> tuple[np.ndarray, np.ndarray]:
        gaps = _unplanes(gap_planes[:, at : at + BLOCK], gap_width)
        top = int(gaps.max())
        if top >= n:
            raise out_of_range
        steps = gaps.astype(np.int64)  # n < 2^62: no gap wraps
        steps += 1
        np.cumsum(steps, out=steps)  # each index + 1, counted from the block's start
        # A sum could wrap round only after exceeding n (each step <= n < 2^62): the largest is checked
        # where the steps could add up to 2^63.
        if steps[-1] > n or ((top + 1) * len(steps) >= 1 << 63 and steps.max() > n):
            raise out_of_range
        return steps, _unzigzag(_unplanes(diff_planes[:, at : at + BLOCK], itemsize), itemsize)

    blocks = list(layout.hash_pool().map(one, range(0, count, BLOCK)))
    carry = -1  # index of the last change before the block (exact: Python integers)
    for steps, _ in blocks:
        reached = carry + int(steps[-1])
        steps += carry
        carry = reached
    if carry >= n:
        raise out_of_range
    return n, itemsize, blocks


def _starts(n: int) -> list[int]:
    return list(range(0, n, CHUNK_ELEMENTS))


def _unplanes(planes: np.ndarray, width: int) -> np.ndarray:
    """Values from their `width` byte planes (rows)."""
    out = np.empty(planes.shape[1], f"<u{width}")
    for j, plane in enumerate(planes):  # (a plane at a time: a transposing copy is slower)
        out.view(np.uint8).reshape(-1, width)[:, j] = plane
    return out


def _zigzag(diffs: np.ndarray, itemsize: int) -> np.ndarray:
    """Unsigned differences as zigzag (0, -1, 1, -2, ... -> 0, 1, 2, 3, ...): small either way."""
    bits = 8 * itemsize
    signed = diffs.view(f"<i{itemsize}")
    return ((signed << 1) ^ (signed >> (bits - 1))).view(f"<u{itemsize}")


def _unzigzag(z: np.ndarray, itemsize: int) -> np.ndarray:
    one = z.dtype.type(1)
    return (z >> one) ^ (-(z & one).view(f"<i{itemsize}")).view(f"<u{itemsize}")

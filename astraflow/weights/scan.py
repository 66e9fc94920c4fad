"""One parallel pass over a freshly written buffer half: what the publisher needs to know of it.

Per chunk of `layout.CHUNK_BYTES`, in the hash pool's threads (numpy and BLAKE3 release the GIL), a
stretch of `SUB_BYTES` at a time: the elements that differ from the served half with their gaps and
differences (the stretch's part of the delta, `codec.Part`), then the stretch goes into the chunk's
digest while it is still in the core's cache. A chunk equal to the served one, bit for bit, keeps the
served one's digest. Non-finite elements (NaN, inf: never served) are counted among the changed ones
only, when there is a served half: its own were counted when it was published.
"""

from __future__ import annotations

from dataclasses import dataclass

import blake3
import numpy as np

from astraflow.weights import codec, layout

EXPONENT = {"bfloat16": 0x7F80, "float16": 0x7C00, "float32": 0x7F800000, "float64": 0x7FF0 << 48}
"""Exponent bits by dtype: all set, the element is NaN or inf."""
SUB_BYTES = 1 << 20
"""Bytes of a chunk compared, then hashed, at a time: the stretch stays in the core's cache (L2) between."""


@dataclass(frozen=True)
class Scan:
    digest: str
    chunk_digests: list[str]
    parts: list[codec.Part] | None
    """The changes since the compared half, chunk by chunk (None: not compared): `codec.encode_parts`."""
    nonfinite: int
    """Elements that are NaN or inf."""


def scan(
    new,
    old=None,
    dtype: str = "bfloat16",
    chunk_bytes: int = layout.CHUNK_BYTES,
    old_digests: list[str] | None = None,
) -> Scan:
    """Digest `new`, compare it with `old` (equally long, or None) and count its non-finite elements.
    `old_digests`: the chunk digests of `old` (its bytes unchanged since they were taken): a chunk equal
    to `old`'s, bit for bit, keeps its digest and is not hashed again."""
    itemsize = layout.ITEMSIZE[dtype]
    kind = np.dtype(f"<u{itemsize}")
    exponent = kind.type(EXPONENT[dtype])
    a = np.frombuffer(new, kind)
    b = np.frombuffer(old, kind) if old is not None else None
    if b is not None and len(a) != len(b):
        raise ValueError(f"buffers differ in length: {a.nbytes} and {b.nbytes} bytes")
    per = chunk_bytes // itemsize
    if old_digests is not None and len(old_digests) != -(-len(a) // per):
        old_digests = None  # of another layout

    def one(start: int) -> tuple[str, list[codec.Part], int]:
        x = a[start : start + per]
        if b is None:
            return layout.chunk_digest(x), [], _nonfinite(x, exponent)
        return _compare_and_digest(x, b[start : start + per], start, exponent, old_digests, start // per)

    found = list(layout.hash_pool().map(one, range(0, len(a), per)))
    chunks = [f[0] for f in found]
    parts = None if b is None else [p for f in found for p in f[1]]
    return Scan(layout.whole_digest(a.nbytes, chunks), chunks, parts, sum(f[2] for f in found))


def _compare_and_digest(x, y, start: int, exponent, old_digests, i: int) -> tuple[str, list[codec.Part], int]:
    """One chunk against the served one: (digest, its part of the delta (none when unchanged), non-finite
    elements among the changed). Compared a stretch of `SUB_BYTES` at a time, each hashed right after
    (still in the core's cache); a chunk that did not change keeps `old_digests[i]` (when given) and is
    not hashed."""
    step = max(SUB_BYTES // x.itemsize, 1)
    h, hashed, found = blake3.blake3(), 0, []
    for at in range(0, len(x), step):
        index, changed, was = codec.compare(x[at : at + step], y[at : at + step])
        if len(index):
            found.append((index + at, changed, was))
        if found or old_digests is None:  # (unchanged so far: maybe not hashed at all)
            h.update(_bytes(x[hashed : at + step]))
            hashed = at + step
    if not found:
        return (old_digests[i] if old_digests is not None else h.hexdigest(layout.DIGEST_BYTES)), [], 0
    index, changed, was = (np.concatenate(a) for a in zip(*found, strict=True))
    part = codec.Part.of(start, index, changed, was)  # one per chunk: the encoder joins few
    return h.hexdigest(layout.DIGEST_BYTES), [part], _nonfinite(changed, exponent)


def _bytes(x: np.ndarray) -> memoryview:
    return memoryview(x).cast("B")


def _nonfinite(x: np.ndarray, exponent) -> int:
    return int(np.count_nonzero((x & exponent) == exponent))

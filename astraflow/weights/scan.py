"""One parallel pass over a freshly written buffer half: what the publisher needs to know of it.

Per chunk of `layout.CHUNK_BYTES`, in the hash pool's threads (numpy and BLAKE3 release the GIL): the
elements that differ from the served half with their gaps and differences (the chunk's part of the
delta, `codec.Part`), then its digest, while the chunk is still in cache; a chunk equal to the served
one, bit for bit, keeps the served one's digest instead. Non-finite elements (NaN, inf: never served) are
counted among the changed ones only, when there is a served half: its own were counted when it was
published.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from astraflow.weights import codec, layout

EXPONENT = {"bfloat16": 0x7F80, "float16": 0x7C00, "float32": 0x7F800000, "float64": 0x7FF0 << 48}
"""Exponent bits by dtype: all set, the element is NaN or inf."""


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
        index, changed, was = codec.compare(x, b[start : start + per])
        if not len(index) and old_digests is not None:  # equal to the served chunk: its digest
            return old_digests[start // per], [], 0
        part = codec.Part.of(start, index, changed, was)
        return layout.chunk_digest(x), [part], _nonfinite(changed, exponent)

    found = list(layout.hash_pool().map(one, range(0, len(a), per)))
    chunks = [f[0] for f in found]
    parts = None if b is None else [p for f in found for p in f[1]]
    return Scan(layout.whole_digest(a.nbytes, chunks), chunks, parts, sum(f[2] for f in found))


def _nonfinite(x: np.ndarray, exponent) -> int:
    return int(np.count_nonzero((x & exponent) == exponent))

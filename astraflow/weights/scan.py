"""One parallel pass over a freshly written buffer half: what the publisher needs to know of it.

Per chunk of `layout.CHUNK_BYTES`, in the hash pool's threads (numpy and BLAKE3 release the GIL, and a
chunk is still in cache for the second look): its digest and the elements that differ from the served
half (the delta's indices). Non-finite elements (NaN, inf: never served) are counted among the changed
ones only, when there is a served half: its own were counted when it was published.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from astraflow.weights import layout

EXPONENT = {"bfloat16": 0x7F80, "float16": 0x7C00, "float32": 0x7F800000, "float64": 0x7FF0 << 48}
"""Exponent bits by dtype: all set, the element is NaN or inf."""


@dataclass(frozen=True)
class Scan:
    digest: str
    chunk_digests: list[str]
    changed: np.ndarray | None
    """Sorted indices of the elements that changed (None: not compared)."""
    nonfinite: int
    """Elements that are NaN or inf."""


def scan(new, old=None, dtype: str = "bfloat16", chunk_bytes: int = layout.CHUNK_BYTES) -> Scan:
    """Digest `new`, compare it with `old` (equally long, or None) and count its non-finite elements."""
    itemsize = layout.ITEMSIZE[dtype]
    kind = np.dtype(f"<u{itemsize}")
    exponent = kind.type(EXPONENT[dtype])
    a = np.frombuffer(new, kind)
    b = np.frombuffer(old, kind) if old is not None else None
    if b is not None and len(a) != len(b):
        raise ValueError(f"buffers differ in length: {a.nbytes} and {b.nbytes} bytes")
    per = chunk_bytes // itemsize

    def one(start: int) -> tuple[str, np.ndarray | None, int]:
        x = a[start : start + per]
        digest = layout.chunk_digest(x)
        changed = None if b is None else np.flatnonzero(x != b[start : start + per]) + start
        return digest, changed, _nonfinite(x if changed is None else x[changed - start], exponent)

    parts = list(layout.hash_pool().map(one, range(0, len(a), per)))
    chunks = [p[0] for p in parts]
    changed = None
    if b is not None:
        changed = np.concatenate([p[1] for p in parts]) if parts else np.empty(0, np.int64)
    return Scan(layout.whole_digest(a.nbytes, chunks), chunks, changed, sum(p[2] for p in parts))


def _nonfinite(x: np.ndarray, exponent) -> int:
    return int(np.count_nonzero((x & exponent) == exponent))

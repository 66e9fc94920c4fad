"""Verifying a full pull as its bytes arrive, so a verified buffer is never read a second time.

A pull fills a buffer over parallel connections and reports each range as it lands (`arrived`). Once
every byte of a chunk has landed since the chunk was last digested, the chunk is digested in the hash
pool while the rest still arrives. `check` then digests again only what changed after its digest (a
source that failed half-way and the next one that rewrote it), compares every chunk with the manifest,
and raises WeightIntegrityError on any difference.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future

from astraflow.errors import WeightIntegrityError
from astraflow.messages import WeightManifest
from astraflow.weights import layout


class ChunkVerifier:
    def __init__(self, data: memoryview, manifest: WeightManifest) -> None:
        self.data, self.manifest = memoryview(data).cast("B"), manifest
        self.size = manifest.chunk_bytes
        n = -(-len(self.data) // self.size)
        if len(manifest.chunk_digests) != n or manifest.nbytes != len(self.data):
            raise WeightIntegrityError(
                f"{manifest.model} v{manifest.version}: manifest lists {len(manifest.chunk_digests)} chunks"
                f" of {manifest.nbytes} bytes, the buffer holds {n} of {len(self.data)}"
            )
        self._fresh = [0] * n  # bytes landed in each chunk since its digest was started
        self._digests: list[Future | None] = [None] * n
        self._lock = threading.Lock()

    def _chunk(self, i: int) -> memoryview:
        return self.data[i * self.size : (i + 1) * self.size]

    def arrived(self, start: int, end: int) -> None:
        """Bytes [start, end) have landed (called from the pulling threads)."""
        with self._lock:
            for i in range(start // self.size, -(-end // self.size)):
                lo, hi = max(start, i * self.size), min(end, (i + 1) * self.size)
                self._fresh[i] += hi - lo
                if self._fresh[i] >= len(self._chunk(i)):
                    self._fresh[i] = 0
                    self._digests[i] = layout.hash_pool().submit(layout.chunk_digest, self._chunk(i))

    def fill(self, read: Callable[[int, memoryview], None]) -> None:
        """Fill every chunk with `read(start, chunk)` in the hash pool's threads, each digested right after
        it is read (still in cache); WeightIntegrityError at the first chunk that differs from the
        manifest (the chunks not started yet are not read). `check` then checks the whole."""
        wrong = threading.Event()

        def one(i: int) -> str:
            if wrong.is_set():
                return ""
            chunk = self._chunk(i)
            read(i * self.size, chunk)
            digest = layout.chunk_digest(chunk)
            if digest != self.manifest.chunk_digests[i]:
                wrong.set()
            return digest

        digests = list(layout.hash_pool().map(one, range(len(self._digests))))
        if wrong.is_set():
            m = self.manifest
            first = next(i for i, d in enumerate(digests) if d != m.chunk_digests[i])
            raise WeightIntegrityError(f"{m.model} v{m.version}: chunk at byte {first * self.size} differs")
        with self._lock:
            for i, digest in enumerate(digests):
                self._fresh[i], self._digests[i] = 0, Future()
                self._digests[i].set_result(digest)  # type: ignore[union-attr]

    def check(self) -> None:
        """Once the pull is done: every chunk as the manifest says, or WeightIntegrityError."""
        pool = layout.hash_pool()
        with self._lock:
            for i, fresh in enumerate(self._fresh):
                if fresh or self._digests[i] is None:
                    self._digests[i] = pool.submit(layout.chunk_digest, self._chunk(i))
            digests = [f.result() for f in self._digests]  # type: ignore[union-attr]
        wrong = [
            i for i, (a, b) in enumerate(zip(digests, self.manifest.chunk_digests, strict=True)) if a != b
        ]
        whole = layout.whole_digest(len(self.data), digests)
        if wrong or whole != self.manifest.digest:
            m = self.manifest
            raise WeightIntegrityError(
                f"{m.model} v{m.version}: {len(wrong)} of {len(digests)} chunks differ from the manifest"
                f" (first at byte {wrong[0] * self.size if wrong else 0}); digest {whole} != {m.digest}"
            )

"""Bytes a trainer serves from files of their own: the deltas of its newest versions, and copies of eval
versions its buffer halves no longer hold (`WeightPublisher`)."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from astraflow.weights import files
from astraflow.weights.server import WeightServer
from astraflow.weights.transport import Source
from astraflow.weights.wire import TransferError


class ServedFiles:
    """Some versions' bytes, each in a private file served as `what` of its version. A dropped file is
    no longer served, and is closed once the transfers reading it have ended (its descriptor is not
    reused under them)."""

    def __init__(self, server: WeightServer, model: str, what: str, directory: Path) -> None:
        self.server, self.model, self.what = server, model, what
        self.dir = files.private_dir(directory)
        self._open: dict[int, BinaryIO] = {}
        self._readers: Counter[BinaryIO] = Counter()
        self._dropped: set[BinaryIO] = set()  # closed by their last reader
        self._lock = threading.Lock()

    @property
    def versions(self) -> list[int]:
        return sorted(self._open)

    def add(self, version: int, data: bytes | memoryview) -> None:
        """Write and serve `data` as `version`; OSError (a full disk) leaves nothing behind."""
        self.drop([version] if version in self._open else [])  # (its readers keep the unlinked file)
        path = self.dir / f"{version}.bin"
        try:
            files.write_private(path, data)
        except OSError:
            path.unlink(missing_ok=True)
            raise
        f = self._open[version] = open(path, "rb")
        hold: Callable = lambda _cut: self._reading(f)  # noqa: E731
        self.server.register(self.model, version, self.what, Source(f.fileno(), 0, len(data), hold=hold))

    def drop(self, versions: Iterable[int]) -> None:
        for version in list(versions):
            self.server.unregister(self.model, version, self.what)
            f = self._open.pop(version)
            (self.dir / f"{version}.bin").unlink(missing_ok=True)
            with self._lock:
                if self._readers[f]:
                    self._dropped.add(f)
                else:
                    f.close()

    @contextmanager
    def _reading(self, f: BinaryIO) -> Iterator[None]:
        with self._lock:
            if f.closed:  # dropped between the server's look-up and now
                raise TransferError("no longer served")
            self._readers[f] += 1
        try:
            yield
        finally:
            with self._lock:
                self._readers[f] -= 1
                if not self._readers[f]:
                    del self._readers[f]
                    if f in self._dropped:
                        self._dropped.discard(f)
                        f.close()

    def close(self) -> None:
        with self._lock:
            for f in [*self._open.values(), *self._dropped]:
                f.close()

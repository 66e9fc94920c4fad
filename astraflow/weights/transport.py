"""Weight bytes over TCP, the pulling side: authenticated connections and a parallel, bounded pull.

The wire (frames, handshake, TLS) is `wire`; the serving side is `server`. Every receive waits at most
`io_timeout_s`, the connection and its handshake at most `handshake_timeout_s` (a frozen peer that
accepts and never answers costs that, not a whole I/O timeout per try), and a pull gives up at its
`deadline` (time.monotonic()), so a stalled peer fails the pull (the receiver then tries the next
source) instead of holding it. An optional token bucket caps the process's egress (cross-region links).
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext

from astraflow.weights import wire
from astraflow.weights.wire import TransferError

PIECE = 1 << 20
"""Largest piece sent in one sendfile call (the rate limiter's granularity)."""
MIN_RANGE_BYTES = 8 << 20
"""Smallest range a parallel pull gives one connection."""


class TokenBucket:
    """Caps bytes per second across threads; `rate` 0 = unlimited."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._lock = threading.Lock()
        self._next = time.monotonic()

    def consume(self, n: int) -> None:
        if self.rate <= 0:
            return
        with self._lock:
            now = time.monotonic()
            start = max(self._next, now)
            self._next = start + n / self.rate
        if start > now:
            time.sleep(start - now)


class Source:
    """Bytes a server can send: `nbytes` at `offset` of an open file, complete or still arriving.

    `hold(cut)` guards the bytes while a transfer reads them (e.g. `DoubleBuffer.reading`); `cut` stops
    that transfer, for a writer that has waited for it long enough."""

    def __init__(
        self,
        fileno: int,
        offset: int,
        nbytes: int,
        complete: bool = True,
        hold: Callable[[Callable[[], None]], AbstractContextManager] = nullcontext,
    ) -> None:
        self.fileno, self.offset, self.nbytes, self.hold = fileno, offset, nbytes, hold
        self._ranges: list[tuple[int, int]] = [(0, nbytes)] if complete else []
        self._cond = threading.Condition()
        self.failed = False

    def arrived(self, start: int, end: int) -> None:
        """Bytes [start, end) are now in the file."""
        with self._cond:
            merged: list[tuple[int, int]] = []  # kept merged: one run per connection filling the source
            for s, e in sorted([*self._ranges, (start, end)]):
                if merged and s <= merged[-1][1]:
                    merged[-1] = (merged[-1][0], max(merged[-1][1], e))
                else:
                    merged.append((s, e))
            self._ranges = merged
            self._cond.notify_all()

    def fail(self) -> None:
        with self._cond:
            self.failed = True
            self._cond.notify_all()

    def _reach(self, pos: int) -> int:
        """End of the bytes that have arrived contiguously from `pos` (`pos` when it has not arrived)."""
        for s, e in self._ranges:
            if s <= pos < e:
                return e
        return pos

    def wait_past(self, pos: int, timeout_s: float = 60.0) -> int:
        """How far the bytes from `pos` reach contiguously, once beyond `pos` (a range pulled in parallel
        is served as it arrives, before the ones ahead of it); raises if the source failed."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.failed or self._reach(pos) > pos, timeout_s):
                raise TransferError("source stalled")
            if self.failed:
                raise TransferError("source failed")
            return self._reach(pos)


class Connection:
    """One authenticated connection to a weight server, for one scope (model, version, what)."""

    def __init__(
        self,
        endpoint: str,
        secret: bytes,
        model: str,
        version: int,
        what: str,
        tls: ssl.SSLContext | None = None,
        io_timeout_s: float = 30.0,
        deadline: float | None = None,
        handshake_timeout_s: float = 5.0,
    ) -> None:
        self.endpoint, self.scope = endpoint, {"model": model, "version": version, "what": what}
        self.io_timeout_s, self.deadline = io_timeout_s, deadline
        host, _, port = endpoint.rpartition(":")
        handshake = min(handshake_timeout_s, self._timeout())
        try:
            self.sock = socket.create_connection((host, int(port)), timeout=handshake)
        except OSError as e:
            raise TransferError(f"{endpoint}: {e}") from None
        try:
            if tls is not None:
                self.sock = tls.wrap_socket(self.sock, server_hostname=host)
            wire.connect(self.sock, secret, self.scope, endpoint)
        except TimeoutError:
            self.sock.close()
            raise TransferError(f"{endpoint}: no handshake within {handshake:.1f} s") from None
        except BaseException:
            self.sock.close()
            raise

    def _timeout(self) -> float:
        """The wait allowed for the next send or receive: `io_timeout_s`, less near the deadline."""
        if self.deadline is None:
            return self.io_timeout_s
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TransferError(f"{self.endpoint}: pull deadline passed")
        return min(self.io_timeout_s, left)

    def fetch(self, into: memoryview, offset: int, on_bytes=None) -> None:
        """Read bytes [offset, offset + len(into)) of the scope's source into `into`; `on_bytes(start, end)`
        is called as they arrive."""
        self.sock.settimeout(self._timeout())  # past the handshake: its shorter timeout no longer applies
        wire.send_frame(self.sock, {**self.scope, "offset": offset, "length": len(into)})
        reply = wire.recv_frame(self.sock)
        if not reply.get("ok"):
            raise TransferError(f"{self.endpoint} {self.scope}: {reply.get('error')}")
        got = 0
        while got < len(into):
            self.sock.settimeout(self._timeout())
            k = self.sock.recv_into(into[got:], min(PIECE, len(into) - got))
            if k == 0:
                raise TransferError(f"connection closed after {got} of {len(into)} bytes")
            if on_bytes is not None:
                on_bytes(offset + got, offset + got + k)
            got += k

    def close(self) -> None:
        self.sock.close()


def pull(
    endpoint: str,
    secret: bytes,
    model: str,
    version: int,
    what: str,
    into: memoryview,
    parallel: int = 4,
    on_bytes: Callable[[int, int], None] | None = None,
    *,
    tls: ssl.SSLContext | None = None,
    io_timeout_s: float = 30.0,
    deadline: float | None = None,
    handshake_timeout_s: float = 5.0,
) -> None:
    """Fill `into` with a whole source over up to `parallel` connections, each reading one range of at
    least `MIN_RANGE_BYTES` (a connection costs a handshake: small buffers come over one). Raises
    TransferError or OSError (a peer that stalls past `io_timeout_s`, or the `deadline`); when one range
    fails the others are cut short."""
    n = len(into)
    step = max(-(-n // max(parallel, 1)), MIN_RANGE_BYTES)
    ranges = [(s, min(s + step, n)) for s in range(0, n, step)] or [(0, 0)]
    failed = threading.Event()
    conns: list[Connection] = []
    lock = threading.Lock()

    def one(rng: tuple[int, int]) -> None:
        if failed.is_set():
            return
        conn = Connection(
            endpoint, secret, model, version, what, tls, io_timeout_s, deadline, handshake_timeout_s
        )
        with lock:
            conns.append(conn)
        try:
            conn.fetch(into[rng[0] : rng[1]], rng[0], on_bytes)
        except BaseException:
            failed.set()
            with lock:
                for other in conns:
                    if other is not conn:
                        wire.shut(other.sock)
            raise
        finally:
            conn.close()

    if len(ranges) == 1:
        one(ranges[0])
        return
    with ThreadPoolExecutor(len(ranges)) as pool:
        futures = [pool.submit(one, r) for r in ranges]
    for f in futures:
        f.result()

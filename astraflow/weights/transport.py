"""Weight bytes over TCP: an authenticated sender of full buffers and deltas, and a parallel puller.

Protocol, per connection: the server sends b"AFW1" and a 32-byte nonce; the client answers with
HMAC-SHA256(run secret, nonce); the server replies b"OK" or b"NO" and closes (counted in `refused`).
Then any number of requests: a u32-length-prefixed JSON {model, version, what, offset, length}, answered
by a u32-length-prefixed JSON {ok, nbytes | error} and the raw bytes, sent with `sendfile` from the
source file. A source still being received (a relay) is sent as its bytes arrive, so chains pipeline.
An optional token bucket caps the process's egress (cross-region links).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import socket
import socketserver
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext

from astraflow.errors import AstraflowError

MAGIC = b"AFW1"
PIECE = 1 << 20
"""Largest piece sent in one sendfile call (the rate limiter's granularity)."""
MIN_RANGE_BYTES = 8 << 20
"""Smallest range a parallel pull gives one connection."""


class TransferError(AstraflowError):
    """A weight transfer failed: unreachable peer, refused request, or a short read."""


class AuthenticationError(TransferError):
    """The peer refused our handshake (wrong or missing run secret)."""


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

    `hold` guards the bytes while a transfer reads them (e.g. `DoubleBuffer.reading`)."""

    def __init__(
        self,
        fileno: int,
        offset: int,
        nbytes: int,
        complete: bool = True,
        hold: Callable[[], AbstractContextManager] = nullcontext,
    ) -> None:
        self.fileno, self.offset, self.nbytes, self.hold = fileno, offset, nbytes, hold
        self._ranges: list[tuple[int, int]] = [(0, nbytes)] if complete else []
        self._cond = threading.Condition()
        self.failed = False

    def arrived(self, start: int, end: int) -> None:
        """Bytes [start, end) are now in the file."""
        with self._cond:
            self._ranges.append((start, end))
            self._cond.notify_all()

    def fail(self) -> None:
        with self._cond:
            self.failed = True
            self._cond.notify_all()

    def _prefix(self) -> int:
        end = 0
        for s, e in sorted(self._ranges):
            if s > end:
                break
            end = max(end, e)
        return end

    def wait_past(self, pos: int, timeout_s: float = 60.0) -> int:
        """How far the contiguous bytes reach, once beyond `pos`; raises if the source failed."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.failed or self._prefix() > pos, timeout_s):
                raise TransferError("source stalled")
            if self.failed:
                raise TransferError("source failed")
            return self._prefix()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise TransferError(f"connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def _send_frame(sock: socket.socket, obj: dict) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(struct.pack("<I", len(data)) + data)


def _recv_frame(sock: socket.socket) -> dict:
    (n,) = struct.unpack("<I", _recv_exact(sock, 4))
    if n > 1 << 20:
        raise TransferError(f"frame of {n} bytes")
    return json.loads(_recv_exact(sock, n))


def _proof(secret: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, b"astraflow-weights:" + nonce, hashlib.sha256).digest()


class WeightServer:
    """Serves registered sources to authenticated peers; `endpoint` is host:port."""

    def __init__(self, secret: bytes, host: str = "127.0.0.1", port: int = 0, egress_bps: float = 0) -> None:
        self.secret = secret
        self.bucket = TokenBucket(egress_bps)
        self.stats: Counter[str] = Counter()
        self._sources: dict[tuple[str, int, str], Source] = {}
        self._lock = threading.Lock()
        server = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                server._serve(self.request)

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self._tcp = socketserver.ThreadingTCPServer((host, port), Handler)
        self._tcp.daemon_threads = True
        self.endpoint = f"{host}:{self._tcp.server_address[1]}"
        self._thread = threading.Thread(target=self._tcp.serve_forever, name="weight-server", daemon=True)
        self._thread.start()

    def register(self, model: str, version: int, what: str, source: Source) -> None:
        with self._lock:
            self._sources[(model, version, what)] = source

    def unregister(self, model: str, version: int, what: str) -> None:
        with self._lock:
            self._sources.pop((model, version, what), None)

    def close(self) -> None:
        self._tcp.shutdown()
        self._tcp.server_close()

    def _serve(self, sock: socket.socket) -> None:
        try:
            nonce = secrets.token_bytes(32)
            sock.sendall(MAGIC + nonce)
            if not hmac.compare_digest(_recv_exact(sock, 32), _proof(self.secret, nonce)):
                self.stats["refused"] += 1
                sock.sendall(b"NO")
                return
            sock.sendall(b"OK")
            while True:
                try:
                    req = _recv_frame(sock)
                except TransferError:
                    return  # the client is done
                self._answer(sock, req)
        except (OSError, TransferError, ValueError):
            self.stats["broken"] += 1

    def _answer(self, sock: socket.socket, req: dict) -> None:
        with self._lock:
            source = self._sources.get((req.get("model"), req.get("version"), req.get("what")))
        start, length = int(req.get("offset", 0)), int(req.get("length", -1))
        if source is None:
            _send_frame(sock, {"ok": False, "error": "not served here"})
            return
        end = source.nbytes if length < 0 else start + length
        if not 0 <= start <= end <= source.nbytes:
            _send_frame(sock, {"ok": False, "error": f"range {start}..{end} outside {source.nbytes}"})
            return
        with source.hold():
            _send_frame(sock, {"ok": True, "nbytes": end - start})
            pos = start
            while pos < end:
                ready = min(source.wait_past(pos), end)
                while pos < ready:
                    n = min(PIECE, ready - pos)
                    self.bucket.consume(n)
                    sent = os.sendfile(sock.fileno(), source.fileno, source.offset + pos, n)
                    if sent == 0:
                        raise TransferError("peer stopped reading")
                    pos += sent
                    self.stats["bytes"] += sent


class Connection:
    """One authenticated connection to a weight server."""

    def __init__(self, endpoint: str, secret: bytes, timeout_s: float = 30.0) -> None:
        host, _, port = endpoint.rpartition(":")
        try:
            self.sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        except OSError as e:
            raise TransferError(f"{endpoint}: {e}") from None
        try:
            hello = _recv_exact(self.sock, 36)
            if hello[:4] != MAGIC:
                raise TransferError(f"{endpoint}: not a weight server")
            self.sock.sendall(_proof(secret, hello[4:]))
            if _recv_exact(self.sock, 2) != b"OK":
                raise AuthenticationError(f"{endpoint}: handshake refused (wrong run secret?)")
        except BaseException:
            self.sock.close()
            raise

    def fetch(
        self, model: str, version: int, what: str, into: memoryview, offset: int, on_bytes=None
    ) -> None:
        """Read bytes [offset, offset + len(into)) of a source into `into`; `on_bytes(start, end)` is
        called as they arrive."""
        req = {"model": model, "version": version, "what": what, "offset": offset, "length": len(into)}
        _send_frame(self.sock, req)
        reply = _recv_frame(self.sock)
        if not reply.get("ok"):
            raise TransferError(f"{model} v{version} {what}: {reply.get('error')}")
        got = 0
        while got < len(into):
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
) -> None:
    """Fill `into` with a whole source over up to `parallel` connections, each reading one range of at
    least `MIN_RANGE_BYTES` (a connection costs a handshake: small buffers come over one)."""
    n = len(into)
    step = max(-(-n // max(parallel, 1)), MIN_RANGE_BYTES)
    ranges = [(s, min(s + step, n)) for s in range(0, n, step)] or [(0, 0)]

    def one(rng: tuple[int, int]) -> None:
        conn = Connection(endpoint, secret)
        try:
            conn.fetch(model, version, what, into[rng[0] : rng[1]], rng[0], on_bytes)
        finally:
            conn.close()

    if len(ranges) == 1:
        one(ranges[0])
        return
    with ThreadPoolExecutor(len(ranges)) as pool:
        for f in [pool.submit(one, r) for r in ranges]:
            f.result()

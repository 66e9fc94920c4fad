"""The weight server: serves registered sources to authenticated peers (see `wire` for the handshake).

After the handshake, any number of requests within its scope: a u32-length-prefixed JSON {model, version,
what, offset, length}, answered by a u32-length-prefixed JSON {ok, nbytes | error} and the raw bytes, sent
with `sendfile` from the source file (read and sent through TLS when it is on). A source still being
received (a relay) is sent as its bytes arrive, so chains pipeline.

No peer can hold the server. Without the secret: the whole handshake must be done within
`handshake_timeout_s` (else dropped, counted `handshake_failed`), and one address has at most
`max_unauthenticated_per_address` connections in the handshake: a newer one closes the oldest of them
(counted `crowded`), so silent connections cannot use up the server, nor keep a puller sharing their
address from starting its handshake; an authenticated connection is never closed for them. Serving slots
are taken only once a peer is authenticated: at most `max_connections` are served at once (one thread
each; more are closed after the handshake, counted `busy`). Every send and receive of a served connection
waits at most `io_timeout_s`, and a transfer reading a buffer half is cut off (its socket shut down) when
the writer of that half has waited long enough (`DoubleBuffer.claim`).
"""

from __future__ import annotations

import os
import select
import socket
import ssl
import threading
import time
from collections import Counter

from astraflow.weights import address, wire
from astraflow.weights.settings import WeightsSettings
from astraflow.weights.transport import PIECE, Source, TokenBucket
from astraflow.weights.wire import TransferError


class WeightServer:
    """Serves registered sources to authenticated peers on `host`; `endpoint` is the host:port others are
    told (`advertise` when given, see `address.endpoint`)."""

    def __init__(
        self,
        secret: bytes,
        host: str = "127.0.0.1",
        port: int = 0,
        egress_bps: float = 0,
        *,
        tls: ssl.SSLContext | None = None,
        io_timeout_s: float = 30.0,
        max_connections: int = 64,
        handshake_timeout_s: float = 5.0,
        max_unauthenticated_per_address: int = 16,
        advertise: str | None = None,
    ) -> None:
        self.secret, self.tls, self.io_timeout_s = secret, tls, io_timeout_s
        self.handshake_timeout_s = handshake_timeout_s
        self.max_unauthenticated = max_unauthenticated_per_address
        self.bucket = TokenBucket(egress_bps)
        self.stats: Counter[str] = Counter()
        self._sources: dict[tuple[str, int, str], Source] = {}
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_connections)
        self._open: set[socket.socket] = set()
        self._unauthenticated: dict[str, list[socket.socket]] = {}  # per peer address, in the handshake
        self._listener = socket.create_server((host, port))
        self.port = self._listener.getsockname()[1]
        self.endpoint = address.endpoint(host, self.port, advertise)
        self._thread = threading.Thread(target=self._accept_loop, name="weight-server", daemon=True)
        self._thread.start()

    @classmethod
    def from_settings(cls, secret: bytes, settings: WeightsSettings) -> WeightServer:
        """A server as `settings` say; an unset `host` (settings not `address.resolved`) is loopback."""
        return cls(
            secret,
            settings.host or address.LOOPBACK,
            settings.port,
            settings.egress_bps,
            tls=wire.tls_contexts(settings)[0],
            io_timeout_s=settings.io_timeout_s,
            max_connections=settings.max_connections,
            handshake_timeout_s=settings.handshake_timeout_s,
            max_unauthenticated_per_address=settings.max_unauthenticated_per_address,
            advertise=settings.advertise,
        )

    def register(self, model: str, version: int, what: str, source: Source) -> None:
        with self._lock:
            self._sources[(model, version, what)] = source

    def unregister(self, model: str, version: int, what: str) -> None:
        with self._lock:
            self._sources.pop((model, version, what), None)

    def close(self) -> None:
        wire.shut(self._listener)  # wakes the accept loop
        self._listener.close()
        self._thread.join()
        with self._lock:
            for sock in list(self._open):
                wire.shut(sock)

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, peer = self._listener.accept()
            except OSError:
                return  # closed
            address = peer[0]
            with self._lock:
                pending = self._unauthenticated.setdefault(address, [])
                oldest = pending.pop(0) if len(pending) >= self.max_unauthenticated else None
                pending.append(sock)
                self._open.add(sock)
            if oldest is not None:  # its thread ends on the closed socket
                self._count("crowded")
                wire.shut(oldest)
            threading.Thread(
                target=self._serve, args=(sock, address), name="weight-send", daemon=True
            ).start()

    def _serve(self, raw: socket.socket, address: str) -> None:
        sock = raw
        try:
            try:
                sock, scope = self._handshake(raw)
            finally:
                with self._lock:
                    pending = self._unauthenticated.get(address, [])
                    if raw in pending:  # (else closed for a newer one)
                        pending.remove(raw)
                    if not pending:
                        self._unauthenticated.pop(address, None)
            if scope is None:
                return
            if not self._slots.acquire(blocking=False):
                self._count("busy")
                return
            try:
                sock.settimeout(self.io_timeout_s)
                while True:
                    try:
                        req = wire.recv_frame(sock)
                    except TransferError:
                        return  # the client is done
                    self._answer(sock, scope, req)
            finally:
                self._slots.release()
        except (OSError, TransferError, ValueError):
            self._count("broken")
        finally:
            with self._lock:
                self._open.discard(sock)
            sock.close()

    def _handshake(self, raw: socket.socket) -> tuple[socket.socket, dict | None]:
        """(the connection, TLS-wrapped when on; the peer's scope, or None when it did not prove the run
        secret within `handshake_timeout_s`)."""
        deadline = time.monotonic() + self.handshake_timeout_s
        sock = raw
        try:
            raw.settimeout(self.handshake_timeout_s)  # a TLS handshake keeps to it as a whole
            if self.tls is not None:
                sock = self.tls.wrap_socket(raw, server_side=True)
                with self._lock:
                    self._open.discard(raw)
                    self._open.add(sock)
            return sock, wire.accept(sock, self.secret, self._refused, deadline)
        except (OSError, TransferError, ValueError):
            self._count("handshake_failed")
            return sock, None

    def _answer(self, sock: socket.socket, scope: dict, req: dict) -> None:
        key = (req.get("model"), req.get("version"), req.get("what"))
        if key != (scope.get("model"), scope.get("version"), scope.get("what")):
            wire.send_frame(sock, {"ok": False, "error": "outside the handshake's scope"})
            return
        with self._lock:
            source = self._sources.get(key)  # type: ignore[arg-type]
        start, length = int(req.get("offset", 0)), int(req.get("length", -1))
        if source is None:
            wire.send_frame(sock, {"ok": False, "error": "not served here"})
            return
        end = source.nbytes if length < 0 else start + length
        if not 0 <= start <= end <= source.nbytes:
            wire.send_frame(sock, {"ok": False, "error": f"range {start}..{end} outside {source.nbytes}"})
            return
        with source.hold(lambda: self._cut_off(sock)):
            wire.send_frame(sock, {"ok": True, "nbytes": end - start})
            pos = start
            while pos < end:
                ready = min(source.wait_past(pos), end)
                while pos < ready:
                    n = min(PIECE, ready - pos)
                    self.bucket.consume(n)
                    sent = self._send(sock, source.fileno, source.offset + pos, n)
                    pos += sent
                    self._count("bytes", sent)

    def _send(self, sock: socket.socket, fileno: int, offset: int, n: int) -> int:
        """Send up to `n` bytes of the file from `offset`; waits at most `io_timeout_s` for the peer."""
        if isinstance(sock, ssl.SSLSocket):
            data = os.pread(fileno, n, offset)
            sock.sendall(data)
            return len(data)
        while True:  # the socket is non-blocking underneath (it has a timeout)
            try:
                sent = os.sendfile(sock.fileno(), fileno, offset, n)
            except BlockingIOError:
                sent = None
            if sent == 0:
                raise TransferError("peer stopped reading")
            if sent is not None:
                return sent
            poll = select.poll()
            poll.register(sock, select.POLLOUT)
            if not poll.poll(self.io_timeout_s * 1000):
                raise TimeoutError(f"peer read nothing for {self.io_timeout_s} s")

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:  # connection threads count at once
            self.stats[name] += n

    def _refused(self) -> None:
        self._count("refused")

    def _cut_off(self, sock: socket.socket) -> None:
        self._count("cut")
        wire.shut(sock)

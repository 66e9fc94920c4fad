"""The weight transport's wire: frames, the mutual handshake, and the optional TLS layer.

Handshake, per connection, for one scope {model, version, what}:

    server -> client  b"AFW2" | server nonce (32)
    client -> server  client nonce (32) | u32-length-prefixed JSON scope | client proof (32)
    server -> client  b"OK" | server proof (32)      (or b"NO" and close: wrong secret)

Each proof is HMAC-SHA256(run secret, role | transcript), the transcript being the magic, both nonces
and the scope, so a proof is good for one session and one version only and neither side can reflect the
other's. The client checks the server's proof: an endpoint that does not know the secret (say, one
written into Redis by someone else) is refused before any byte is trusted. The server answers requests
of that scope only. TLS (`weights.tls`) wraps the socket before the handshake. The server gives the whole
handshake one `deadline` (a peer trickling bytes cannot stretch it), so a peer without the secret cannot
hold a connection for longer than that.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import socket
import ssl
import struct
import time
from collections.abc import Callable

from astraflow.errors import AstraflowError
from astraflow.weights.settings import WeightsSettings

MAGIC = b"AFW2"
NONCE_BYTES = 32
MAX_FRAME_BYTES = 1 << 20


class TransferError(AstraflowError):
    """A weight transfer failed: unreachable peer, refused request, or a short read."""


class AuthenticationError(TransferError):
    """A handshake failed: the peer refused our proof, or could not prove it knows the run secret."""


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """`n` bytes; with a `deadline` (time.monotonic()) all of them by then, else TimeoutError."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"deadline passed after {got} of {n} bytes")
            sock.settimeout(left)
        k = sock.recv_into(view[got:])
        if k == 0:
            raise TransferError(f"connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def shut(sock: socket.socket) -> None:
    """Shut a connection down under whichever thread uses it (that thread's send or receive fails)."""
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)  # the plain socket's, also under TLS
    except OSError:
        pass


def encode_frame(obj: dict) -> bytes:
    data = json.dumps(obj, sort_keys=True).encode()
    return struct.pack("<I", len(data)) + data


def send_frame(sock: socket.socket, obj: dict) -> None:
    sock.sendall(encode_frame(obj))


def recv_frame(sock: socket.socket, deadline: float | None = None) -> dict:
    (n,) = struct.unpack("<I", recv_exact(sock, 4, deadline))
    if n > MAX_FRAME_BYTES:
        raise TransferError(f"frame of {n} bytes")
    obj = json.loads(recv_exact(sock, n, deadline))
    if not isinstance(obj, dict):
        raise TransferError("frame is not an object")
    return obj


def _proof(secret: bytes, role: bytes, server_nonce: bytes, client_nonce: bytes, scope: dict) -> bytes:
    transcript = b"|".join([MAGIC, role, server_nonce, client_nonce, encode_frame(scope)])
    return hmac.new(secret, transcript, hashlib.sha256).digest()


def accept(
    sock: socket.socket, secret: bytes, refused: Callable[[], None], deadline: float | None = None
) -> dict | None:
    """Server side of the handshake: the client's scope, or None when its proof is wrong (then
    `refused()` is called before the client hears so). Every byte of the client's part must have come
    by `deadline` (time.monotonic()), else TimeoutError."""
    server_nonce = secrets.token_bytes(NONCE_BYTES)
    sock.sendall(MAGIC + server_nonce)
    client_nonce = recv_exact(sock, NONCE_BYTES, deadline)
    scope = recv_frame(sock, deadline)
    proof = recv_exact(sock, 32, deadline)
    if not hmac.compare_digest(proof, _proof(secret, b"client", server_nonce, client_nonce, scope)):
        refused()
        sock.sendall(b"NO")
        return None
    sock.sendall(b"OK" + _proof(secret, b"server", server_nonce, client_nonce, scope))
    return scope


def connect(sock: socket.socket, secret: bytes, scope: dict, endpoint: str) -> None:
    """Client side of the handshake; raises AuthenticationError unless both sides proved the secret."""
    hello = recv_exact(sock, len(MAGIC) + NONCE_BYTES)
    if hello[: len(MAGIC)] != MAGIC:
        raise TransferError(f"{endpoint}: not a weight server")
    server_nonce, client_nonce = hello[len(MAGIC) :], secrets.token_bytes(NONCE_BYTES)
    proof = _proof(secret, b"client", server_nonce, client_nonce, scope)
    sock.sendall(client_nonce + encode_frame(scope) + proof)
    if recv_exact(sock, 2) != b"OK":
        raise AuthenticationError(f"{endpoint}: handshake refused (wrong run secret?)")
    expected = _proof(secret, b"server", server_nonce, client_nonce, scope)
    if not hmac.compare_digest(recv_exact(sock, 32), expected):
        raise AuthenticationError(f"{endpoint}: the server did not prove the run secret")


def tls_contexts(settings: WeightsSettings) -> tuple[ssl.SSLContext | None, ssl.SSLContext | None]:
    """(server, client) TLS contexts of the weight transport; (None, None) = plaintext."""
    if not settings.tls:
        return None, None
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.minimum_version = ssl.TLSVersion.TLSv1_2
    server.load_cert_chain(settings.tls_cert, settings.tls_key)  # type: ignore[arg-type]
    client = ssl.create_default_context(cafile=settings.tls_ca)  # verifies the certificate and host
    client.minimum_version = ssl.TLSVersion.TLSv1_2
    return server, client

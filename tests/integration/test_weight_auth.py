"""Who may move weights: both ends of a connection prove the run secret, a proof is good for its own
session and version only, and with `weights.tls` the bytes travel encrypted to a verified server."""

from __future__ import annotations

import secrets
import shutil
import socket
import subprocess
import threading

import pytest

from astraflow.weights import wire
from astraflow.weights.receiver import WeightReceiver
from astraflow.weights.server import WeightServer
from astraflow.weights.settings import WeightsSettings
from astraflow.weights.transport import Connection
from astraflow.weights.wire import AuthenticationError, TransferError
from tests.integration.test_weights import MODEL, publish, trainer

pytestmark = pytest.mark.integration


class Impostor:
    """An endpoint that speaks the protocol without the secret: accepts any proof, answers with noise."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            conn.sendall(wire.MAGIC + secrets.token_bytes(wire.NONCE_BYTES))
            wire.recv_exact(conn, wire.NONCE_BYTES)
            wire.recv_frame(conn)
            wire.recv_exact(conn, 32)
            conn.sendall(b"OK" + secrets.token_bytes(32))
            conn.recv(1)


def test_a_server_that_cannot_prove_the_secret_is_refused():
    impostor = Impostor()
    try:
        with pytest.raises(AuthenticationError, match="did not prove"):
            Connection(impostor.endpoint, b"the secret", MODEL, 0, "full")
    finally:
        impostor.sock.close()


def test_a_connection_serves_only_the_version_it_was_authenticated_for(tmp_path):
    server = WeightServer(b"the secret")
    try:
        conn = Connection(server.endpoint, b"the secret", MODEL, 0, "full")
        wire.send_frame(conn.sock, {"model": MODEL, "version": 1, "what": "full", "offset": 0, "length": 1})
        reply = wire.recv_frame(conn.sock)
        assert not reply["ok"] and "scope" in reply["error"]
        conn.close()
    finally:
        server.close()


def make_certs(d) -> dict:
    """A CA and a server certificate for 127.0.0.1 signed by it (openssl CLI)."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=test-ca")
    run("req", *ec, "-keyout", "srv.key", "-out", "srv.csr", "-subj", "/CN=127.0.0.1")
    (d / "ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run(
        "x509", "-req", "-in", "srv.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "srv.pem", "-days", "1", "-extfile", "ext",
    )  # fmt: skip
    return {"tls": True, "tls_cert": d / "srv.pem", "tls_key": d / "srv.key", "tls_ca": d / "ca.pem"}


async def test_weights_move_over_tls_and_a_plaintext_peer_gets_nothing(bus, tmp_path):
    certs = tmp_path / "certs"
    certs.mkdir()
    tls = WeightsSettings(full_every=100, same_host=False, **make_certs(certs))
    pub, state, secret = await trainer(bus, tls, tmp_path / "t")
    rx = WeightReceiver(bus, tls, MODEL, tmp_path / "rx", secret, WeightServer.from_settings(secret, tls))
    plain_settings = WeightsSettings(io_timeout_s=0.5, same_host=False)
    plain = WeightReceiver(bus, plain_settings, MODEL, tmp_path / "p", secret, WeightServer(secret))
    try:
        key = await publish(pub, state, 0)
        half = await rx.sync(key, 0)
        assert bytes(half.data) == bytes(pub.buffer.served.data)
        with pytest.raises(TransferError):
            await plain.sync(key, 0)
        assert pub.server.stats["bytes"] == len(half.data)  # nothing went out in plaintext
    finally:
        for r in (rx, plain):
            r.close()
            r.server.close()
        await pub.close()


def test_tls_needs_its_files():
    with pytest.raises(ValueError, match="tls_key"):
        WeightsSettings(tls=True, tls_cert="c.pem", tls_ca="ca.pem")


async def test_an_impostor_in_the_peers_set_is_refused_pruned_and_the_trainer_serves(bus, tmp_path):
    settings = WeightsSettings(full_every=100, same_host=False)
    pub, state, secret = await trainer(bus, settings, tmp_path / "t")
    impostor = Impostor()
    rx = WeightReceiver(bus, settings, MODEL, tmp_path / "rx", secret, WeightServer(secret))
    try:
        key = await publish(pub, state, 0)
        peers = bus.keys.weight_peers(MODEL, 0)
        await bus.redis.zadd(peers, {f"local|{impostor.endpoint}": 1})  # anyone who may write the run's keys
        half = await rx.sync(key, 0)
        assert bytes(half.data) == bytes(pub.buffer.served.data)
        assert f"local|{impostor.endpoint}".encode() not in await bus.redis.zrange(peers, 0, -1)
    finally:
        impostor.sock.close()
        rx.close()
        rx.server.close()
        await pub.close()

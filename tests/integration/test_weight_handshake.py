"""A weight server cannot be starved without the secret: connections that never finish the handshake take
no serving slot and are dropped at the handshake deadline, however they trickle, and one address cannot
keep more than its cap of them, while authenticated pulls of a registered buffer go on."""

from __future__ import annotations

import os
import secrets
import socket
import struct
import time

import pytest

from astraflow.weights import wire
from astraflow.weights.server import WeightServer
from astraflow.weights.transport import Connection, Source, pull
from tests.integration.test_weights import MODEL

pytestmark = pytest.mark.integration
SECRET = b"the run secret"
NBYTES = 32 << 20  # pulled over 4 connections (transport.MIN_RANGE_BYTES each)


@pytest.fixture
def served(tmp_path):
    """(a function making a WeightServer that serves version 0 of MODEL, the bytes it serves)."""
    data = secrets.token_bytes(NBYTES)
    (tmp_path / "full.bin").write_bytes(data)
    fd = os.open(tmp_path / "full.bin", os.O_RDONLY)
    servers: list[WeightServer] = []

    def make(**kwargs) -> WeightServer:
        server = WeightServer(SECRET, **kwargs)
        server.register(MODEL, 0, "full", Source(fd, 0, NBYTES))
        servers.append(server)
        return server

    yield make, data
    for server in servers:
        server.close()
    os.close(fd)


def silent(server: WeightServer, source: str) -> socket.socket:
    """A connection from `source` (a loopback address) that reads the server's hello and says nothing."""
    host, port = server.endpoint.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=20, source_address=(source, 0))
    assert len(wire.recv_exact(sock, 36)) == 36  # in the handshake (not refused)
    return sock


def still_open(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1) != b""
    except BlockingIOError:
        return True  # nothing to read, not closed
    finally:
        sock.settimeout(20)


def pulled(server: WeightServer) -> bytes:
    into = bytearray(NBYTES)
    pull(server.endpoint, SECRET, MODEL, 0, "full", memoryview(into), parallel=4)
    return bytes(into)


def test_200_silent_connections_do_not_stop_pulls(served):
    make, data = served
    server = make(handshake_timeout_s=60.0)  # they stay for the whole test
    # 200 > max_connections (64): from 13 addresses, under the per-address cap (16), so all are held.
    held = [silent(server, f"127.0.1.{1 + i // 16}") for i in range(200)]
    try:
        for _ in range(5):
            assert pulled(server) == data
        assert all(still_open(sock) for sock in held)  # the pulls went on while all 200 were held
        assert server.stats["busy"] == 0
    finally:
        for sock in held:
            sock.close()


def test_silent_and_trickling_connections_are_dropped_at_the_handshake_deadline(served):
    make, data = served
    server = make(handshake_timeout_s=0.5)
    held = [silent(server, f"127.0.1.{1 + i // 16}") for i in range(200)]
    trickler = silent(server, "127.0.2.1")
    # A well-formed start of the client's part (nonce, then a 1000-byte scope frame), a byte every 0.1 s:
    # each arrives well within any per-receive timeout, and the frame is never complete nor malformed.
    part = secrets.token_bytes(wire.NONCE_BYTES) + struct.pack("<I", 1000) + b" " * 1000
    dropped = False
    for i in range(600):
        try:
            trickler.sendall(part[i : i + 1])
        except OSError:
            dropped = True
            break
        time.sleep(0.1)
    assert dropped
    for sock in held:
        assert sock.recv(1) == b""  # dropped by the server, not held
        sock.close()
    trickler.close()
    assert server.stats["handshake_failed"] == 201
    assert pulled(server) == data


def test_a_new_connection_past_an_addresss_cap_closes_its_oldest_silent_one(served):
    make, data = served
    server = make(max_unauthenticated_per_address=4, handshake_timeout_s=60.0)
    peer = Connection(server.endpoint, SECRET, MODEL, 0, "full")  # authenticated, from 127.0.0.1
    held = [silent(server, "127.0.1.1") for _ in range(4)]
    newer = [silent(server, "127.0.1.1") for _ in range(6)]  # each got the hello: in the handshake
    try:
        assert [still_open(sock) for sock in held + newer] == [False] * 4 + [False] * 2 + [True] * 4
        assert server.stats["crowded"] == 6
        into = bytearray(NBYTES)
        peer.fetch(memoryview(into), 0)  # the authenticated peer is not affected
        assert bytes(into) == data
        assert pulled(server) == data  # nor is another address
    finally:
        peer.close()
        for sock in [*held, *newer]:
            sock.close()


def test_silent_connections_from_the_pullers_own_address_do_not_stop_its_pulls(served):
    """The attack: seventy silent connections from the puller's address closed its pulls ('crowded')."""
    make, data = served
    server = make(handshake_timeout_s=60.0)
    held = [silent(server, "127.0.0.1") for _ in range(70)]
    try:
        for _ in range(3):
            assert pulled(server) == data
        assert server.stats["crowded"] >= 70 - 16
    finally:
        for sock in held:
            sock.close()

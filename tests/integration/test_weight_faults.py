"""The weight transport under stalled and misbehaving peers: a reader that stops reading cannot stop the
trainer publishing, a peer silent in the handshake is dropped, connections past the limit are refused,
and a receiver skips (and prunes) a stalled or trickling peer and still gets the version."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import threading

import pytest
import torch

from astraflow.errors import WeightIntegrityError
from astraflow.messages import VersionNotice
from astraflow.raas.follow import NoticeFollower
from astraflow.weights import wire
from astraflow.weights.peers import MAX_PROBED
from astraflow.weights.receiver import WeightReceiver
from astraflow.weights.server import WeightServer
from astraflow.weights.settings import WeightsSettings
from astraflow.weights.transport import Connection, Source
from astraflow.weights.wire import TransferError
from tests.integration.test_weights import MODEL, publish, trainer

pytestmark = pytest.mark.integration


def recv_all(sock: socket.socket) -> int:
    """Bytes read until the peer closes."""
    total = 0
    while chunk := sock.recv(1 << 20):
        total += len(chunk)
    return total


async def test_a_reader_that_stops_reading_does_not_stop_the_trainer_publishing(bus, tmp_path):
    settings = WeightsSettings(full_every=100, reader_grace_s=0.5)
    state = {"w": torch.randn(2048, 4096)}  # 16 MB served: more than the socket buffers hold
    pub, state, secret = await trainer(bus, settings, tmp_path / "t", state)
    try:
        await publish(pub, state, 0)
        stalled = Connection(pub.server.endpoint, secret, MODEL, 0, "full")
        wire.send_frame(stalled.sock, {**stalled.scope, "offset": 0, "length": -1})
        nbytes = wire.recv_frame(stalled.sock)["nbytes"]  # the server holds version 0's half from here
        for version in (1, 2):  # version 2 is written into the half the stalled peer reads
            state["w"][version] += 1
            await asyncio.wait_for(publish(pub, state, version), 60)  # a hang guard, not a timing check
        assert pub.buffer.served.version == 2
        stalled.sock.settimeout(30)
        assert recv_all(stalled.sock) < nbytes  # it was cut off
        stalled.close()
    finally:
        await pub.close()


def test_a_peer_silent_in_the_handshake_is_dropped():
    server = WeightServer(b"secret", handshake_timeout_s=0.5)
    try:
        sock = socket.create_connection(server.endpoint.rsplit(":", 1), timeout=20)
        assert len(wire.recv_exact(sock, 36)) == 36  # the server's hello; we never answer
        assert sock.recv(1) == b""  # dropped, not held
        sock.close()
    finally:
        server.close()


def test_authenticated_connections_past_the_limit_are_refused():
    server = WeightServer(b"secret", max_connections=2)
    try:
        held = [Connection(server.endpoint, b"secret", MODEL, 0, "full") for _ in range(2)]
        extra = Connection(server.endpoint, b"secret", MODEL, 0, "full")
        with pytest.raises((TransferError, OSError)):
            extra.fetch(memoryview(bytearray(1)), 0)  # closed after its handshake: no slot for it
        assert server.stats["busy"] == 1
        for conn in [*held, extra]:
            conn.close()
    finally:
        server.close()


async def test_a_stalled_peer_is_skipped_pruned_and_the_trainer_serves(bus, tmp_path):
    """A peer that accepts and never answers (a frozen RaaS) costs a puller its handshake timeout, not its
    I/O timeout (60 s here: a run would stall for it at every try)."""
    settings = WeightsSettings(full_every=100, same_host=False, io_timeout_s=60, handshake_timeout_s=0.5)
    pub, state, secret = await trainer(bus, settings, tmp_path / "t")
    stalled = socket.create_server(("127.0.0.1", 0))  # accepts (in the kernel), never says a word
    endpoint = f"127.0.0.1:{stalled.getsockname()[1]}"
    rx = WeightReceiver(bus, settings, MODEL, tmp_path / "rx", secret, WeightServer(secret))
    try:
        key = await publish(pub, state, 0)
        peers = bus.keys.weight_peers(MODEL, 0)
        await bus.redis.zadd(peers, {f"local|{endpoint}": 1})
        half = await asyncio.wait_for(rx.sync(key, 0), 20)  # well within one I/O timeout
        assert bytes(half.data) == bytes(pub.buffer.served.data)
        assert f"local|{endpoint}".encode() not in await bus.redis.zrange(peers, 0, -1)
    finally:
        stalled.close()
        rx.close()
        rx.server.close()
        await pub.close()


async def test_a_trickling_peer_is_given_up_at_the_pull_deadline(bus, tmp_path):
    settings = WeightsSettings(full_every=100, same_host=False, pull_deadline_s=1.0)
    pub, state, secret = await trainer(bus, settings, tmp_path / "t")
    # A peer that knows the secret and sends 512 bytes every 0.1 s: never silent, never done.
    key = await publish(pub, state, 0)
    nbytes = len(pub.buffer.served.data)
    path = tmp_path / "slow.bin"
    path.write_bytes(bytes(pub.buffer.served.data))
    fd = os.open(path, os.O_RDONLY)
    slow, source, done = WeightServer(secret), Source(fd, 0, nbytes, complete=False), threading.Event()
    slow.register(MODEL, 0, "full", source)

    def trickle() -> None:
        for start in range(0, nbytes, 512):
            if done.wait(0.1):
                return
            source.arrived(start, min(start + 512, nbytes))

    threading.Thread(target=trickle, daemon=True).start()
    rx = WeightReceiver(bus, settings, MODEL, tmp_path / "rx", secret, WeightServer(secret))
    try:
        peers = bus.keys.weight_peers(MODEL, 0)
        await bus.redis.zadd(peers, {f"local|{slow.endpoint}": 1})
        half = await rx.sync(key, 0)
        assert bytes(half.data) == bytes(pub.buffer.served.data)
        assert rx.stats["transfer_errors"] == 1  # the first attempt ran out of time on the peer
        assert f"local|{slow.endpoint}".encode() not in await bus.redis.zrange(peers, 0, -1)
    finally:
        done.set()
        source.fail()
        slow.close()
        os.close(fd)
        rx.close()
        rx.server.close()
        await pub.close()


async def test_a_peer_set_of_silent_peers_costs_a_pull_one_probe_then_nothing(bus, tmp_path):
    """The attack: 200 silent peers, added to the peer set faster than pullers pruned them, held the
    trainer at v15 for 50 s. Only peers that answer an authenticated probe are tried: a pull probes at
    most MAX_PROBED of them, and those that did not answer are not probed again for BACKOFF_S."""
    settings = WeightsSettings(full_every=100, same_host=False, io_timeout_s=60, handshake_timeout_s=5)
    pub, state, secret = await trainer(bus, settings, tmp_path / "t", {"w": torch.randn(64, 64)})
    silent = [socket.create_server(("127.0.0.1", 0)) for _ in range(20)]  # accept, never say a word
    endpoints = [f"127.0.0.1:{s.getsockname()[1]}" for s in silent]
    rx = WeightReceiver(bus, settings, MODEL, tmp_path / "rx", secret, WeightServer(secret))
    try:
        for version in (0, 1):
            key = await publish(pub, state, version)
            peers = bus.keys.weight_peers(MODEL, version)
            await bus.redis.zadd(peers, {f"local|{e}": 1000 + i for i, e in enumerate(endpoints)})
            half = await asyncio.wait_for(rx.sync(key, version), 20)  # (each silent one tried: 100 s)
            assert bytes(half.data) == bytes(pub.buffer.served.data)
        assert rx.peers.probes == MAX_PROBED  # the newest 8, once: the second pull probed none again
        assert rx.stats["full_pulls"] + rx.stats.get("delta_pulls", 0) >= 1
    finally:
        for s in silent:
            s.close()
        rx.close()
        rx.server.close()
        await pub.close()


class Engine:
    """Records what it was asked to load (the engine is not what is tested)."""

    def __init__(self) -> None:
        self.loaded: list[int] = []

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    async def load_weights(self, path: str, version: int) -> None:
        self.loaded.append(version)


async def test_weights_changed_between_their_check_and_the_load_are_refused(bus, tmp_path):
    """Outside the threat model (the same uid), but cheap to close: NaN written into the verified buffer
    between its check and the load got 3,829 groups dead in 25 s. The load digests it again."""
    settings = WeightsSettings(full_every=100, same_host=False)
    pub, state, secret = await trainer(bus, settings, tmp_path / "t", {"w": torch.randn(256, 256)})
    rx = WeightReceiver(bus, settings, MODEL, tmp_path / "rx", secret, WeightServer(secret))
    engine = Engine()
    follower = NoticeFollower(bus, {MODEL: engine}, {MODEL: rx}, None)  # type: ignore[arg-type]
    try:
        key = await publish(pub, state, 0)
        notice = VersionNotice(uid="n0", version=0, models={MODEL: 0}, manifests={MODEL: key})
        half = await rx.sync(key, 0)  # pulled and verified: the follower's sync returns this half
        half.data[:4] = struct.pack("<f", float("nan"))
        with pytest.raises(WeightIntegrityError, match="chunks differ from the manifest"):
            await follower._load(MODEL, engine, 0, notice)
        assert engine.loaded == []
        half = await rx.sync(key, 0)  # pulled again, not taken as held
        assert bytes(half.data) == bytes(pub.buffer.served.data)
    finally:
        rx.close()
        rx.server.close()
        await pub.close()

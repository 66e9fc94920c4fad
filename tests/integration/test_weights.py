"""The weight manager against a real Redis over loopback TCP: full then delta syncs reproduce the trainer's
served bytes exactly, a corrupted delta or a byte flipped in transit is refused and healed by a full
pull, a client without the run secret is refused, and a receiver relays to the next one."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest
import torch

from astraflow.messages import WeightManifest, decode
from astraflow.weights import layout
from astraflow.weights.published import run_secret
from astraflow.weights.publisher import WeightPublisher
from astraflow.weights.receiver import WeightReceiver
from astraflow.weights.server import WeightServer
from astraflow.weights.settings import WeightsSettings
from astraflow.weights.transport import Connection
from astraflow.weights.wire import AuthenticationError, TransferError

pytestmark = pytest.mark.integration
MODEL = "policy"


def state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(300, 64, generator=g)
    return {
        "embed.weight": emb,
        "layer.weight": torch.randn(64, 64, generator=g),
        "lm_head.weight": emb,
        "norm.weight": torch.ones(64),
    }


def step(state: dict[str, torch.Tensor], frac: float, seed: int) -> None:
    """Change a fraction of the elements, like an optimizer step would."""
    g = torch.Generator().manual_seed(seed)
    for t in state.values():
        mask = torch.rand(t.shape, generator=g) < frac
        t.add_(mask * torch.randn(t.shape, generator=g))


async def trainer(bus, settings: WeightsSettings, root, state=None):
    """A publisher of `state` (default `state_dict()`) under `root`: (publisher, state, secret)."""
    secret = await run_secret(bus, settings)
    state = state_dict() if state is None else state
    return (
        WeightPublisher(bus, settings, MODEL, layout.layout(state, "bfloat16"), root, secret),
        state,
        secret,
    )


@pytest.fixture
async def trainer_side(bus, tmp_path):
    settings = WeightsSettings(full_every=100, same_host=False)  # over TCP (the file: test_weight_local)
    pub, state, secret = await trainer(bus, settings, tmp_path / "trainer")
    yield pub, state, secret, settings
    await pub.close()


def receiver(bus, settings, secret, tmp_path, name: str) -> WeightReceiver:
    server = WeightServer(secret)
    return WeightReceiver(bus, settings, MODEL, tmp_path / name, secret, server)


async def publish(pub: WeightPublisher, state, version: int) -> str:
    await pub.publish(state, version, step=version)
    await pub.wait()
    return pub.bus.keys.weights(MODEL, version)


async def test_full_then_deltas_reproduce_the_served_bytes(bus, tmp_path, trainer_side):
    pub, state, secret, settings = trainer_side
    rx = receiver(bus, settings, secret, tmp_path, "rx")
    try:
        for v in range(4):
            if v:
                step(state, 0.01, v)
            half = await rx.sync(await publish(pub, state, v), v)
            assert bytes(half.data) == bytes(pub.buffer.served.data)
        assert (rx.stats["full_pulls"], rx.stats["delta_pulls"]) == (1, 3)
        # The half is a loadable safetensors file holding the bf16 weights.
        from safetensors.torch import load_file

        loaded = load_file(half.path)
        assert torch.equal(loaded["layer.weight"], state["layer.weight"].to(torch.bfloat16))
        assert "lm_head.weight" not in loaded  # tied to the embedding
    finally:
        rx.close()
        rx.server.close()


async def test_the_served_version_checkpointed_again_keeps_its_delta_and_stays_served(
    bus, tmp_path, trainer_side
):
    """A clean stop checkpoints the version it served: a receiver a version behind still gets its delta
    from the trainer (no delta of the version against itself replaces it, nor is it unserved)."""
    pub, state, secret, settings = trainer_side
    rx = receiver(bus, settings, secret, tmp_path, "rx")
    try:
        await rx.sync(await publish(pub, state, 0), 0)
        step(state, 0.01, 1)
        key = await publish(pub, state, 1)
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)
        await pub.publish(state, 1, step=1, durable=done)  # the stop's checkpoint of version 1
        await pub.wait()
        manifest = decode(await bus.redis.hgetall(key), WeightManifest)
        assert (manifest.kind, manifest.base_version) == ("delta", 0)
        half = await rx.sync(key, 1)
        assert bytes(half.data) == bytes(pub.buffer.served.data)
        assert rx.stats["delta_pulls"] == 1 and not rx.stats["transfer_errors"]
    finally:
        rx.close()
        rx.server.close()


async def test_a_corrupt_delta_is_refused_and_a_full_pull_heals_it(bus, tmp_path, trainer_side):
    pub, state, secret, settings = trainer_side
    rx = receiver(bus, settings, secret, tmp_path, "rx")
    try:
        await rx.sync(await publish(pub, state, 0), 0)
        step(state, 0.01, 1)
        await pub.publish(state, 1, step=1)
        await pub.wait()
        delta_file = pub.deltas.dir / "1.bin"
        data = bytearray(delta_file.read_bytes())
        data[-1] ^= 0xFF  # at rest, after its digest went into the manifest
        delta_file.write_bytes(data)
        half = await rx.sync(bus.keys.weights(MODEL, 1), 1)
        assert rx.stats["integrity_errors"] == 1 and rx.stats["full_pulls"] == 2
        assert bytes(half.data) == bytes(pub.buffer.served.data)
    finally:
        rx.close()
        rx.server.close()


class FlippingProxy:
    """Forwards one TCP connection at a time to `target`, flipping one byte of the first big reply."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.flipped = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            host, _, port = self.target.rpartition(":")
            upstream = socket.create_connection((host, int(port)))
            threading.Thread(target=self._pipe, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, flip: bool) -> None:
        try:
            while data := src.recv(65536):
                if flip and not self.flipped and len(data) > 10_000:
                    data = bytearray(data)
                    data[len(data) // 2] ^= 0x01
                    self.flipped = True
                dst.sendall(data)
        except OSError:
            pass
        finally:
            dst.close()


async def test_a_byte_flipped_in_transit_is_refused_and_pulled_again(bus, tmp_path, trainer_side):
    pub, state, secret, settings = trainer_side
    proxy = FlippingProxy(pub.server.endpoint)
    pub.server.endpoint = proxy.endpoint  # the manifest advertises the proxy
    rx = receiver(bus, settings.model_copy(update={"parallel": 1}), secret, tmp_path, "rx")
    try:
        half = await rx.sync(await publish(pub, state, 0), 0)
        assert proxy.flipped and rx.stats["integrity_errors"] == 1
        assert bytes(half.data) == bytes(pub.buffer.served.data)
    finally:
        proxy.sock.close()
        rx.close()
        rx.server.close()


async def test_a_client_without_the_secret_is_refused(bus, tmp_path, trainer_side):
    pub, state, _, settings = trainer_side
    await publish(pub, state, 0)
    with pytest.raises(AuthenticationError):
        Connection(pub.server.endpoint, b"not the secret", MODEL, 0, "full")
    assert pub.server.stats["refused"] == 1
    rx = receiver(bus, settings, b"not the secret", tmp_path, "rx")
    with pytest.raises(TransferError):
        await rx.sync(bus.keys.weights(MODEL, 0), 0)
    rx.close()
    rx.server.close()


async def test_a_second_receiver_pulls_from_the_first(bus, tmp_path, trainer_side):
    pub, state, secret, settings = trainer_side
    first, second = (receiver(bus, settings, secret, tmp_path, n) for n in ("a", "b"))
    try:
        key = await publish(pub, state, 0)
        await first.sync(key, 0)
        sent_by_trainer = pub.server.stats["bytes"]
        half = await second.sync(key, 0)
        assert bytes(half.data) == bytes(pub.buffer.served.data)
        assert pub.server.stats["bytes"] == sent_by_trainer  # nothing more from the trainer
        assert first.server.stats["bytes"] == len(half.data)
    finally:
        for rx in (first, second):
            rx.close()
            rx.server.close()


async def test_an_eval_version_stays_served_after_its_trainer_moved_on(bus, tmp_path, trainer_side):
    """The barrier announces an eval version once every trainer reached it, and every RaaS must load
    exactly it: a trainer that ran ahead still serves it (whole), though its halves hold newer ones,
    until the barrier announced a later version."""
    pub, state, secret, settings = trainer_side
    rx = receiver(bus, settings, secret, tmp_path, "rx")
    try:
        await rx.sync(await publish(pub, state, 9), 9)
        step(state, 1.0, 10)
        await pub.publish(state, 10, step=10, eval_=True)
        await pub.wait()
        evaluated = bytes(pub.buffer.served.data)
        for v in (11, 12, 13):
            step(state, 1.0, v)
            await publish(pub, state, v)
        half = await rx.sync(bus.keys.weights(MODEL, 10), 10)
        assert bytes(half.data) == evaluated
        assert not rx.stats["transfer_errors"] and not rx.stats["integrity_errors"]
        assert [p.name for p in pub.evals.dir.iterdir()] == ["10.bin"]

        await bus.redis.hset(bus.keys.state, "notice", 11)  # the barrier passed version 10
        step(state, 1.0, 14)
        await publish(pub, state, 14)
        assert list(pub.evals.dir.iterdir()) == []
        # In step with the barrier (it passed eval version 20 before its half was written): no copy.
        for v in (20, 21, 22):
            await bus.redis.hset(bus.keys.state, "notice", v)
            await pub.publish(state, v, step=v, eval_=v == 20)
            await pub.wait()
        assert list(pub.evals.dir.iterdir()) == []
    finally:
        rx.close()
        rx.server.close()


async def test_weights_holding_nan_are_never_served_or_announced(bus, tmp_path, trainer_side):
    """The publisher is the last line before any engine: a version whose weights hold a NaN (an update
    that blew up) is refused; the version before it stays the served one and nothing is announced."""
    from astraflow.errors import NonFiniteWeights

    pub, state, _, _ = trainer_side
    await publish(pub, state, 0)
    state["layer.weight"][3, 5] = float("nan")
    await pub.publish(state, 1, step=1)
    with pytest.raises(NonFiniteWeights, match="1 weights are NaN or inf"):
        await pub.wait()
    assert pub.buffer.served.version == 0
    assert not await bus.redis.exists(bus.keys.weights(MODEL, 1))
    assert await bus.redis.xlen(bus.keys.versions) == 1

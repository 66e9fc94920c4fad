"""The regional relay against a real Redis, with region b behind a counting proxy that stands for the
long link: per version, the bytes crossing into region b are one delta (or one full buffer when a full
pull is due) whatever the number of receivers there; an elected relay killed (-9) or stopped mid-pull is
replaced and every receiver still ends with the verified version."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import pytest
import torch

from astraflow.messages import WeightManifest, decode
from astraflow.weights import layout
from astraflow.weights.published import run_secret
from astraflow.weights.publisher import WeightPublisher
from astraflow.weights.receiver import WeightReceiver
from astraflow.weights.server import WeightServer
from astraflow.weights.settings import WeightsSettings
from tests.integration.test_weights import publish, step
from tests.link_proxy import LinkProxy

pytestmark = pytest.mark.integration
MODEL = "policy"
HANDSHAKES = 4096
"""Bytes of handshakes and request frames a few connections add to the payload (generous)."""


def state_dict() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"embed.weight": torch.randn(1024, 512, generator=g), "norm.weight": torch.ones(512)}  # ~1 MB bf16


@pytest.fixture
async def far_trainer(bus, tmp_path):
    """A trainer whose weight server region b reaches only through a LinkProxy (1 MB/s, 5 ms)."""
    proxy = LinkProxy(latency_s=0.005, bps=1 << 20)
    settings = WeightsSettings(
        full_every=3, same_host=False, host="127.0.0.1", advertise=f"127.0.0.1:{proxy.port}"
    )
    secret = await run_secret(bus, settings)
    state = state_dict()
    specs = layout.layout(state, "bfloat16")
    pub = WeightPublisher(bus, settings, MODEL, specs, tmp_path / "trainer", secret)
    proxy.target = ("127.0.0.1", pub.server.port)
    yield pub, state, secret, proxy
    await pub.close()
    proxy.close()


def region_b(bus, secret, tmp_path, n: int, name: str = "b") -> list[WeightReceiver]:
    settings = WeightsSettings(io_timeout_s=2.0, same_host=False)
    return [
        WeightReceiver(
            bus, settings, MODEL, tmp_path / f"{name}{i}", secret, WeightServer(secret), region="b"
        )
        for i in range(n)
    ]


def close(receivers: list[WeightReceiver]) -> None:
    for rx in receivers:
        rx.close()
        rx.server.close()


async def manifest(bus, version: int) -> WeightManifest:
    return decode(await bus.redis.hgetall(bus.keys.weights(MODEL, version)), WeightManifest)


@pytest.mark.parametrize("n", [1, 4])
async def test_one_delta_or_full_crosses_into_the_region_per_version_whatever_the_receivers(
    bus, tmp_path, far_trainer, n
):
    pub, state, secret, proxy = far_trainer
    receivers = region_b(bus, secret, tmp_path, n)
    crossed = []
    try:
        for v in range(4):  # v0 full (nothing held), v1 and v2 deltas, v3 full (full_every 3)
            if v:
                step(state, 0.01, v)
            key = await publish(pub, state, v)
            proxy.reset()
            await asyncio.gather(*(rx.sync(key, v) for rx in receivers))
            crossed.append(proxy.down)
            for rx in receivers:
                assert bytes(rx.buffer.served.data) == bytes(pub.buffer.served.data)
        m = [await manifest(bus, v) for v in range(4)]
        sizes = [m[0].nbytes, m[1].delta_nbytes, m[2].delta_nbytes, m[3].nbytes]
        assert m[3].kind == "full" and 0 < sizes[1] < m[0].nbytes // 10
        print(f"\nregion b with {n} receivers: bytes over the link per version {crossed} (payload {sizes})")
        for got, size in zip(crossed, sizes, strict=True):
            assert size <= got <= size + HANDSHAKES
        assert sum(rx.stats["relay_pulls"] for rx in receivers) == 4  # one relay per version
        assert sum(rx.stats["relayed_pulls"] for rx in receivers) == 4 * (n - 1)
    finally:
        close(receivers)


async def test_a_version_republished_by_a_restarted_trainer_elects_its_own_relay(bus, tmp_path, far_trainer):
    pub, state, secret, proxy = far_trainer
    before = region_b(bus, secret, tmp_path, 2)
    restarted = None
    try:
        key = await publish(pub, state, 0)
        await asyncio.gather(*(rx.sync(key, 0) for rx in before))  # their relay serves the old bytes of v0
        state["embed.weight"].add_(1.0)  # the restarted trainer's v0 is other weights
        restarted = WeightPublisher(bus, pub.settings, MODEL, pub.specs, tmp_path / "restarted", secret)
        proxy.target = ("127.0.0.1", restarted.server.port)
        await publish(restarted, state, 0)
        proxy.reset()
        after = region_b(bus, secret, tmp_path, 3, name="after")
        before += after
        await asyncio.gather(*(rx.sync(key, 0) for rx in after))
        for rx in after:
            assert bytes(rx.buffer.served.data) == bytes(restarted.buffer.served.data)
            assert rx.stats["integrity_errors"] == rx.stats["relay_failovers"] == 0
        assert (
            restarted.buffer.served.data.nbytes
            <= proxy.down
            <= restarted.buffer.served.data.nbytes + HANDSHAKES
        )
    finally:
        if restarted is not None:
            await restarted.close()
        close(before)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kill", "stop"])
async def test_a_relay_killed_or_stopped_mid_pull_is_replaced(bus, tmp_path, far_trainer, fault, redis_url):
    pub, state, secret, proxy = far_trainer
    key = await publish(pub, state, 0)
    full = pub.buffer.served.data.nbytes
    peer = [sys.executable, "-m", "tests.integration.relay_peer"]
    relay = subprocess.Popen(
        [*peer, redis_url, "it", key, "0", str(tmp_path / "r")],
        stdout=subprocess.PIPE,
        text=True,
    )
    followers = region_b(bus, secret, tmp_path, 3)
    try:
        endpoint = relay.stdout.readline().strip()  # type: ignore[union-attr]
        seat = bus.keys.weight_relay(MODEL, 0, pub.incarnation, "b", "full")
        while await bus.redis.get(seat) != endpoint.encode() or proxy.down < full // 5:
            assert relay.poll() is None
            await asyncio.sleep(0.02)
        syncs = [asyncio.ensure_future(rx.sync(key, 0)) for rx in followers]
        await asyncio.sleep(0.3)  # the followers pull from the relay, which is still receiving
        os.kill(relay.pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        await asyncio.wait_for(asyncio.gather(*syncs), 60)
        for rx in followers:
            assert bytes(rx.buffer.served.data) == bytes(pub.buffer.served.data)
            assert rx.stats["relay_failovers"] >= 1  # each found the relay gone and asked again
        assert sum(rx.stats["relay_pulls"] for rx in followers) == 1  # one took its seat
        assert (await bus.redis.get(seat)).decode() != endpoint
        assert proxy.down < 2.2 * full  # what the dead relay got, and one more full buffer: not one each
    finally:
        os.kill(relay.pid, signal.SIGKILL)
        if fault == "stop":
            os.kill(relay.pid, signal.SIGCONT)
        relay.wait()
        close(followers)


async def test_a_stopping_receiver_leaves_the_peers_and_its_relay_seat(bus, tmp_path, far_trainer):
    """A cleanly stopped RaaS is no longer offered as a source: out of the version's peers and off the
    relay seat it won (the others logged `weights_source_failed` against it before)."""
    pub, state, secret, _ = far_trainer
    receivers = region_b(bus, secret, tmp_path, 2)
    try:
        key = await publish(pub, state, 0)
        await asyncio.gather(*(rx.sync(key, 0) for rx in receivers))
        relay, other = sorted(receivers, key=lambda rx: not rx.election.won)
        seats = sorted(relay.election.won)
        peers = bus.keys.weight_peers(MODEL, 0)
        member = lambda rx: f"b|{rx.server.endpoint}".encode()  # noqa: E731
        assert seats and await bus.redis.get(seats[0]) == relay.server.endpoint.encode()
        assert {member(relay), member(other)} <= set(await bus.redis.zrange(peers, 0, -1))

        await relay.leave()
        assert await bus.redis.exists(*seats) == 0
        assert set(await bus.redis.zrange(peers, 0, -1)) == {member(other)}
        assert (await relay.election.elect(await manifest(bus, 0), "full")) == relay.server.endpoint
    finally:
        close(receivers)

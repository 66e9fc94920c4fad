"""Versions built on the device (`weights.build_on: device`, here on CPU tensors, where the device is the
CPU) against a real Redis: the same manifests as the host path plus the device checksum, receivers over
TCP reproduce the bytes, an engine-side reader in another process takes the version from the shared
record and checks it, and NaN never reaches a shared record."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from astraflow.errors import NonFiniteWeights
from astraflow.messages import WeightManifest, decode
from astraflow.weights import device
from astraflow.weights.settings import WeightsSettings
from astraflow.weights.share import SharedVersion
from tests.integration.test_weights import MODEL, publish, receiver, state_dict, step, trainer

pytestmark = pytest.mark.integration


async def manifests(bus, root, build_on: str) -> list[WeightManifest]:
    settings = WeightsSettings(full_every=3, same_host=False, build_on=build_on)
    pub, state, _ = await trainer(bus, settings, root, state_dict())
    out = []
    try:
        for v in range(4):  # full, delta, delta, full
            if v:
                step(state, 0.05, v)
            key = await publish(pub, state, v)
            out.append(decode(await bus.redis.hgetall(key), WeightManifest))
    finally:
        await pub.close()
    return out


async def test_device_path_publishes_the_host_path_manifests_and_a_checksum(bus, tmp_path):
    host = await manifests(bus, tmp_path / "host", "host")
    on_device = await manifests(bus, tmp_path / "device", "device")
    assert [m.kind for m in on_device] == ["full", "delta", "delta", "full"]
    for a, b in zip(host, on_device, strict=True):
        assert (a.digest, a.chunk_digests, a.delta_digest, a.delta_nbytes) == (
            b.digest,
            b.chunk_digests,
            b.delta_digest,
            b.delta_nbytes,
        )
        assert a.device_checksum == "" and b.device_checksum


async def test_a_receiver_over_tcp_reproduces_device_built_versions(bus, tmp_path):
    settings = WeightsSettings(full_every=100, same_host=False, build_on="device")
    pub, state, secret = await trainer(bus, settings, tmp_path / "trainer")
    rx = receiver(bus, settings, secret, tmp_path, "rx")
    try:
        for v in range(3):
            if v:
                step(state, 0.05, v)
            key = await publish(pub, state, v)
            half = await rx.sync(key, v)
            manifest = decode(await bus.redis.hgetall(key), WeightManifest)
            assert bytes(half.data) == bytes(pub.buffer.served.data)
            flat = torch.frombuffer(bytearray(half.data), dtype=torch.uint8)
            assert device.checksum(flat) == manifest.device_checksum
        assert rx.stats["delta_pulls"] == 2
    finally:
        rx.close()
        rx.server.close()
        await pub.close()


TAKE = """
import json, sys, torch
from astraflow.weights.share import Reader, SharedVersion
shared = SharedVersion.decode(bytes.fromhex(sys.argv[1]))
reader = Reader("cpu")
try:
    flat = reader.take(shared)
    held = flat.numpy().tobytes().hex() if flat is not None else ""
    print(json.dumps({"took": flat is not None, "bytes": held}))
except Exception as e:
    print(json.dumps({"error": type(e).__name__}))
"""


def take_elsewhere(record: bytes) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", TAKE, record.hex()], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.slow  # three Python processes that import torch
@pytest.mark.timeout(300)
async def test_another_process_takes_the_shared_version_and_checks_it(bus, tmp_path):
    settings = WeightsSettings(full_every=100, build_on="device")
    pub, state, _ = await trainer(bus, settings, tmp_path / "trainer")
    try:
        await publish(pub, state, 0)
        step(state, 0.05, 1)
        await publish(pub, state, 1)
        record = await bus.redis.get(bus.keys.weights_shared(MODEL, 1))
        shared = SharedVersion.decode(record)
        assert shared.version == 1 and shared.file is not None and shared.cuda is None
        got = take_elsewhere(record)
        assert bytes.fromhex(got["bytes"]) == bytes(pub.buffer.served.data)
        forged = SharedVersion.decode(record).__class__(**{**shared.__dict__, "checksum": "0" * 32})
        assert take_elsewhere(forged.encode()) == {"error": "WeightIntegrityError"}
        elsewhere = shared.__class__(**{**shared.__dict__, "host": "another-boot-id"})
        assert take_elsewhere(elsewhere.encode()) == {"took": False, "bytes": ""}
    finally:
        await pub.close()


async def test_nan_built_on_the_device_is_never_shared(bus, tmp_path):
    settings = WeightsSettings(full_every=100, build_on="device")
    pub, state, _ = await trainer(bus, settings, tmp_path / "trainer")
    try:
        await publish(pub, state, 0)
        state["layer.weight"][3, 5] = float("nan")
        with pytest.raises(NonFiniteWeights):
            await publish(pub, state, 1)
        assert await bus.redis.get(bus.keys.weights_shared(MODEL, 1)) is None
        assert not await bus.redis.exists(bus.keys.weights(MODEL, 1))
    finally:
        pub._finishing = None
        await pub.close()

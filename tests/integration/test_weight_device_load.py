"""An hf engine takes versions as tensors, no file opened (`raas.device_load`), against a real Redis: from
the trainer's shared version on this host, else the receiver's half copied to the engine's device, then a
delta applied on that device. After each load the engine's parameters are the served bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from astraflow.engines.hf import HFEngine
from astraflow.engines.settings import EngineSettings
from astraflow.messages import WeightManifest, decode
from astraflow.raas.device_load import DeviceLoader
from astraflow.weights import layout
from astraflow.weights.published import run_secret
from astraflow.weights.publisher import WeightPublisher
from astraflow.weights.settings import WeightsSettings
from tests.integration.test_weights import MODEL, publish, receiver

pytestmark = pytest.mark.integration


@pytest.fixture
async def engine(tiny_model):
    e = HFEngine(EngineSettings(type="hf", model=str(tiny_model), dtype="bfloat16", device="cpu"))
    await e.start()
    yield e
    await e.close()


def holds(engine: HFEngine, served: memoryview, specs) -> bool:
    """Every served tensor equals the engine's parameter, bit for bit."""
    flat = np.frombuffer(served, np.uint8)
    for s in specs:
        want = torch.from_numpy(flat[s.offset : s.offset + s.nbytes].copy()).view(torch.bfloat16)
        if not torch.equal(engine.model.get_parameter(s.name).detach().flatten(), want):
            return False
    return True


async def trained(bus, tiny_model, tmp_path, build_on: str, same_host: bool):
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    state = model.state_dict()
    specs = layout.layout(state, "bfloat16")
    settings = WeightsSettings(full_every=100, same_host=same_host, build_on=build_on)
    secret = await run_secret(bus, settings)
    pub = WeightPublisher(bus, settings, MODEL, specs, tmp_path / "trainer", secret)
    return model, state, specs, pub, settings, secret


def train(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_((torch.rand(p.shape, generator=g) < 0.05) * 1e-2)


async def manifest_of(bus, version: int) -> WeightManifest:
    return decode(await bus.redis.hgetall(bus.keys.weights(MODEL, version)), WeightManifest)


async def test_an_engine_on_the_trainers_host_takes_the_shared_version(bus, tiny_model, tmp_path, engine):
    model, state, specs, pub, _, _ = await trained(bus, tiny_model, tmp_path, "device", True)
    loader = DeviceLoader(bus)
    try:
        for v in range(2):
            if v:
                train(model, v)
            await publish(pub, state, v)
            assert await loader.shared(MODEL, engine, await manifest_of(bus, v))
            assert loader.last[MODEL] == "shared" and engine.version == v
            assert holds(engine, pub.buffer.served.data, specs)
    finally:
        loader.close()
        await pub.close()


async def test_pulled_versions_are_copied_then_patched_on_the_engines_device(
    bus, tiny_model, tmp_path, engine
):
    model, state, specs, pub, settings, secret = await trained(bus, tiny_model, tmp_path, "host", False)
    rx = receiver(bus, settings, secret, tmp_path, "rx")
    loader = DeviceLoader(bus)
    ways = []
    try:
        for v in range(3):
            if v:
                train(model, v)
            key = await publish(pub, state, v)
            manifest = await manifest_of(bus, v)
            assert not await loader.shared(MODEL, engine, manifest)  # built on the host: nothing shared
            half = await rx.sync(key, v)
            await loader.from_half(MODEL, engine, manifest, half, rx.delta_of(v))
            ways.append(loader.last[MODEL])
            assert engine.version == v and holds(engine, pub.buffer.served.data, specs)
        assert ways == ["half", "delta", "delta"]
    finally:
        loader.close()
        rx.close()
        rx.server.close()
        await pub.close()

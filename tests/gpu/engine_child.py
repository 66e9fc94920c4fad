"""The engine side of `tests/gpu/device_rows.py`, in a process of its own (as a RaaS is): takes each
version its parent names on stdin and prints, per version, one JSON line: when it was served (wall
clock), the way it came and the engine's pause.

    python -m tests.gpu.engine_child REDIS_URL DEVICE MODE [MODEL_DIR]

MODE `shared`: from the trainer's shared version on this host (`raas.device_load`, CUDA IPC on a GPU);
`tcp`: pulled over loopback TCP as from another host (a delta applied on the device). With MODEL_DIR an
hf engine on DEVICE takes each version while it generates; without, a bare stand-in that only holds the
tensors (the weight path alone, as at the 7B shape).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

from astraflow.config import RedisSettings, StreamsSettings
from astraflow.engines.base import GenerateRequest, SamplingParams
from astraflow.messages import WeightManifest, decode
from astraflow.raas.device_load import DeviceLoader
from astraflow.streams import Bus
from astraflow.weights.published import run_secret
from astraflow.weights.receiver import WeightReceiver
from astraflow.weights.server import WeightServer
from astraflow.weights.settings import WeightsSettings

MODEL = "policy"
RUN = "device-rows"
"""The run both sides name (the keys' namespace)."""


class Holder:
    """An engine reduced to what a load touches: it keeps the tensors it is given (views of the loader's
    verified copy, not copied again: the 7B shape fits an 80 GB GPU)."""

    version = 0

    def __init__(self, device: str) -> None:
        self.tensors_device, self.held = device, {}

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    async def load_tensors(self, tensors, version: int) -> None:
        self.held = dict(tensors)
        self.version = version


async def generating(engine) -> None:
    """Requests one after another, so that every load pauses a generating engine."""
    params = SamplingParams(max_new_tokens=32)
    while True:
        await engine.generate(GenerateRequest(list(range(10, 42)), params))


async def main(url: str, device: str, mode: str, model_dir: str | None) -> None:
    bus = Bus.connect(url, RUN, RedisSettings(), StreamsSettings())
    engine, background = Holder(device), None
    if model_dir:
        from astraflow.engines.hf import HFEngine
        from astraflow.engines.settings import EngineSettings

        engine = HFEngine(EngineSettings(type="hf", model=model_dir, dtype="bfloat16", device=device))
        await engine.start()
        background = asyncio.create_task(generating(engine))
    loader, rx = DeviceLoader(bus), None
    with tempfile.TemporaryDirectory() as tmp:
        if mode == "tcp":
            settings = WeightsSettings(same_host=False)
            secret = await run_secret(bus, settings)
            rx = WeightReceiver(bus, settings, MODEL, Path(tmp), secret, WeightServer(secret))
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            version = int(line)
            key = bus.keys.weights(MODEL, version)
            manifest = decode(await bus.redis.hgetall(key), WeightManifest)
            if rx is None:
                if not await loader.shared(MODEL, engine, manifest):
                    raise RuntimeError(f"version {version} was not taken from the shared version")
            else:
                half = await rx.sync(key, version)
                with rx.buffer.reading(half):  # type: ignore[union-attr]
                    await loader.from_half(MODEL, engine, manifest, half, rx.delta_of(version))
            if device.startswith("cuda"):
                import torch

                torch.cuda.synchronize()
            done = {"version": version, "served_at": time.time(), "way": loader.last[MODEL]}
            print(json.dumps({**done, "pause_s": loader.pause_s[MODEL]}), flush=True)
        if background is not None:
            background.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await background
            await engine.close()
        if rx is not None:
            rx.close()
            rx.server.close()
        loader.close()
        await bus.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else None))

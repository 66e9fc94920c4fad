"""Run real RaaS worker processes (hf engine, tiny model) against the test Redis."""

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from astraflow.config import Settings
from astraflow.messages import PromptGroup, RolloutGroup, WeightManifest, decode, encode
from astraflow.settings_load import to_env
from astraflow.streams import Bus, Out
from astraflow.weights import layout
from astraflow.workflows.tasks import rows


def raas_settings(url: str, model: str, tmp_path, worker: str, **raas) -> Settings:
    s = Settings()
    s.run.name, s.run.dir = "it", tmp_path
    s.redis.url = url
    s.streams.lease_ms, s.streams.block_ms = 1000, 200
    s.engine.type, s.engine.model = "hf", model
    s.raas.id, s.raas.heartbeat_ms, s.raas.grace_s = worker, 300, 5
    s.raas.sampling.max_new_tokens = 4
    for k, v in raas.items():
        setattr(s.raas, k, v)
    return s


def spawn_raas(settings: Settings) -> subprocess.Popen:
    """A worker in a session of its own, so a test can kill it with all it started (as a crash would)."""
    env = {**os.environ, **to_env(settings), "OMP_NUM_THREADS": "1"}
    log = open(settings.run.path / f"{settings.raas.id}.log", "wb")
    return subprocess.Popen(
        [sys.executable, "-m", "workers.raas"],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=log,
        start_new_session=True,
    )


async def submit(bus: Bus, n: int, start: int = 0, n_samples: int = 2, workflow: str = "rlvr", **extra):
    groups = []
    for i, row in enumerate(rows("addition", n, seed=start), start=start):
        groups.append(
            PromptGroup(
                uid=f"g{i:04d}",
                workflow=workflow,
                models=["policy"],
                n_samples=n_samples,
                version=0,
                sample={**row, **extra},
            )
        )
    await bus.publish_many([Out(bus.keys.prompts, encode(g), f"prompt:{g.uid}") for g in groups])
    return [g.uid for g in groups]


async def rollouts(bus: Bus) -> list[RolloutGroup]:
    return [decode(f, RolloutGroup) for _, f in await bus.redis.xrange(bus.keys.rollouts)]


async def wait_for(cond, timeout_s: float = 60, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await cond():
            return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"timed out waiting for {what}")


def stop(proc: subprocess.Popen, timeout_s: float = 30) -> int:
    """SIGTERM and wait; then end whatever the worker left in its session (reward pool, servers)."""
    if proc.poll() is None:
        proc.terminate()
    try:
        return proc.wait(timeout=timeout_s)
    finally:
        kill_session(proc)


def kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


async def checkpoint_manifest(bus: Bus, directory: str, model: str, version: int) -> str:
    """Write the manifest of a checkpoint directory's weights (what its trainer would have published);
    returns its key. A RaaS loads a checkpoint only if it matches its manifest."""
    from safetensors.torch import load_file

    state = load_file(Path(directory) / "model.safetensors")
    specs = layout.layout(state, "float32")  # tiny models are saved in float32
    data = b"".join(state[s.name].contiguous().numpy().tobytes() for s in specs)
    whole, chunks = layout.digests(data)
    manifest = WeightManifest(
        uid=f"{model}:{version}:checkpoint",
        model=model,
        version=version,
        kind="full",
        base_version=None,
        endpoints=[],
        nbytes=len(data),
        digest=whole,
        chunk_digests=chunks,
        tensors=specs,
        incarnation="checkpoint",
    )
    key = bus.keys.weights(model, version)
    await bus.redis.hset(key, mapping=encode(manifest))
    return key

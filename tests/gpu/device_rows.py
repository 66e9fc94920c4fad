"""Rows of `tests/gpu/check.py` for versions built and taken on the device (`weights.build_on: device`,
`weights.share`, `raas.device_load`): each in milliseconds and in multiples of `m` (one device-to-host
copy of the served bytes into pinned memory; on the CPU dry run one memcpy).

The trainer side runs here (a publisher of the model's state on the device, Adam's first step emulated at
lr 1e-6 between versions: every element moves by lr); the engine side in another process
(`tests.gpu.engine_child`), told each version once its manifest is written, which it then takes: from
the shared version (CUDA IPC on a GPU) or over loopback TCP as from another host. `publish to served`
is from the trainer's `publish` call to the child's engine holding the version (the dataflow's notice,
a Redis round trip, is not in it). Versions: 0 full, 1 and 2 deltas, 3 full (`full_every` 3).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.gpu import engine_child
from tests.gpu.checks import ROOT, Row, child_env
from tests.gpu.children import ChildError, child_error

LR = 1e-6
QWEN_7B = dict(hidden=3584, layers=28, heads=28, kv_heads=4, intermediate=18944, vocab_size=152064)
"""Qwen2.5-7B's shape (embeddings untied)."""


CONFIG_NAMES = dict(
    hidden="hidden_size", layers="num_hidden_layers", heads="num_attention_heads",
    kv_heads="num_key_value_heads", intermediate="intermediate_size", vocab_size="vocab_size",
)  # fmt: skip
"""`tiny.SHAPES`' keys as Qwen2Config's."""


def config(dims: dict, tied: bool):
    from transformers import Qwen2Config

    return Qwen2Config(**{CONFIG_NAMES[k]: v for k, v in dims.items()}, tie_word_embeddings=tied)


def random_state(dims: dict, device: str) -> dict:
    """A bf16 state dict of the shape's parameters, random, on `device` (no model, no optimizer: the 7B
    shape's weight path fits beside it on an 80 GB GPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config(dims, tied=False))
    g = torch.Generator(device=device).manual_seed(0)
    return {
        n: (torch.randn(p.shape, generator=g, device=device) * 0.02).to(torch.bfloat16)
        for n, p in meta.named_parameters()
    }


CHANGED = 0.025
"""Share of bf16 elements a bf16 state's emulated step moves by one unit in the last place (what a real
lr-1e-6 AdamW step changes: 2.4% at the 0.5B shape, `tests/bench/weight_path.py`)."""


def emulated_step(state: dict, seed: int) -> None:
    """Adam's first step at lr 1e-6 on an fp32 master: every element moves by lr; on a bf16 state (no
    master) `CHANGED` of the elements move by one unit in the last place. Tied tensors once."""
    import torch

    seen = set()
    g = None
    for t in state.values():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        g = g or torch.Generator(device=t.device).manual_seed(seed)
        if t.dtype == torch.bfloat16:
            moved = torch.rand(t.shape, generator=g, device=t.device) < CHANGED
            t.view(torch.int16).add_(moved.to(torch.int16))
        else:
            t.add_(torch.randn(t.shape, generator=g, device=t.device).sign_(), alpha=-LR)


def copy_limit_s(nbytes: int, device: str) -> float:
    from tests.bench import weight_path as bench

    return bench.memcpy_s(nbytes) if device == "cpu" else bench.d2h_s(nbytes, device)


async def versions(
    url: str, state: dict, device: str, mode: str, model_dir: Path | None, buffers: Path
) -> list[dict]:
    """Publish versions 0-3 of `state` and have the engine child take each: per version `blocked` and
    `served` (seconds from `publish`), the way it came and the child's engine pause."""
    from astraflow.config import RedisSettings, StreamsSettings
    from astraflow.streams import Bus
    from astraflow.weights import layout
    from astraflow.weights.published import run_secret
    from astraflow.weights.publisher import WeightPublisher
    from astraflow.weights.settings import WeightsSettings

    bus = Bus.connect(url, engine_child.RUN, RedisSettings(), StreamsSettings())
    settings = WeightsSettings(full_every=3, build_on="device", same_host=mode != "tcp")
    secret = await run_secret(bus, settings)
    specs = layout.layout(state, "bfloat16")
    cmd = [
        sys.executable,
        "-m",
        "tests.gpu.engine_child",
        url,
        device,
        mode,
        *([str(model_dir)] * bool(model_dir)),
    ]
    child = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=child_env(),
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out = []
    with tempfile.TemporaryDirectory(dir=buffers) as tmp:
        pub = WeightPublisher(bus, settings, "policy", specs, Path(tmp), secret)
        try:
            await line_of(child)  # ready
            for v in range(4):
                if v:
                    emulated_step(state, v)
                sync(device)
                at, started = time.time(), time.perf_counter()
                await pub.publish(state, v, step=v)
                blocked = time.perf_counter() - started
                await pub.wait()
                child.stdin.write(f"{v}\n")  # type: ignore[union-attr]
                child.stdin.flush()  # type: ignore[union-attr]
                got = await line_of(child)
                out.append({"blocked": blocked, "served": got["served_at"] - at, **got})
        finally:
            child.stdin.close()  # type: ignore[union-attr]
            await asyncio.to_thread(child.wait, 120)
            await pub.close()
            await bus.close()
    return out


async def line_of(child: subprocess.Popen) -> dict:
    line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 300)  # type: ignore[union-attr]
    if not line:
        raise ChildError(child_error(child.stderr.read()))  # type: ignore[union-attr]
    return json.loads(line)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def measured(seconds: float, m: float) -> str:
    return f"{seconds * 1000:.1f} ms = {seconds / m:.2f}m"


def run(tmp: Path, state: dict, device: str, mode: str, model_dir: Path | None, buffers: Path) -> list[dict]:
    """`versions` against a Redis of its own."""
    from astraflow import redis_server

    server = redis_server.start(Path(tempfile.mkdtemp(dir=tmp)) / "redis")
    try:
        return asyncio.run(versions(server.url, state, device, mode, model_dir, buffers))
    finally:
        server.stop()


def device_path(label: str, model_dir: Path, device: str, tmp: Path, buffers: Path) -> list[Row]:
    """The model's versions into an hf engine in another process that generates meanwhile: by the shared
    version (same host) and over loopback TCP (another host, the delta applied on its device)."""
    import torch
    from transformers import AutoModelForCausalLM

    gpu = device == "cuda"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    state = model.state_dict()
    nbytes = sum(t.numel() for t in {t.data_ptr(): t for t in state.values()}.values()) * 2
    m = copy_limit_s(nbytes, device)
    same = run(tmp, state, device, "shared", model_dir, buffers)
    tcp = run(tmp, state, device, "tcp", model_dir, buffers)
    del model, state
    blocked = statistics.median(r["blocked"] for r in same[1:])
    pause = max(r["pause_s"] for r in same[1:])
    name = f"on the device {label}"
    rows = [
        Row(f"{name}: m (reference)", measured(m, m), "reference", True, judged=False),
        Row(f"{name}: trainer blocked per version", measured(blocked, m), "<= 10 ms", blocked <= 0.010, gpu),
        Row(
            f"{name}: ways the engines took versions",
            f"same host {ways(same)}; other host {ways(tcp)}",
            "shared x4; half, delta, delta, half",
            ways(same) == "shared x4" and ways(tcp) == "half, delta, delta, half",
        ),
    ]
    for kind, v in (("delta", 2), ("full", 3)):
        s = same[v]["served"]
        rows.append(
            Row(f"{name}: publish to served, IPC, {kind}", measured(s, m), "<= 100 ms", s <= 0.1, gpu)
        )
    rows.append(
        Row(f"{name}: engine pause per load, generating", measured(pause, m), "<= 20 ms", pause <= 0.02, gpu)
    )
    s = tcp[2]["served"]
    rows.append(
        Row(
            f"{name}: to another host, loopback TCP, delta on the device",
            measured(s, m),
            "<= 1 s",
            s <= 1,
            gpu,
        )
    )
    return rows


def ways(rs: list[dict]) -> str:
    found = [r["way"] for r in rs]
    return f"shared x{len(found)}" if set(found) == {"shared"} else ", ".join(found)


def seven_b(device: str, tmp: Path, buffers: Path, dims: dict) -> list[Row]:
    """The 7B shape's weight path only (no model, no optimizer state): publish to served, by IPC, into a
    process that only holds the tensors."""
    state = random_state(dims, device)
    nbytes = sum(t.numel() for t in state.values()) * 2
    m = copy_limit_s(nbytes, device)
    same = run(tmp, state, device, "shared", None, buffers)
    del state
    worst = max(same[2]["served"], same[3]["served"])
    what = f"7B shape{'' if device == 'cuda' else ' (tiny stand-in)'}, bf16 state, {nbytes / 2**30:.2f} GiB"
    return [
        Row(
            f"on the device {what}: publish to served, IPC (worst of delta, full)",
            measured(worst, m),
            "<= 400 ms",
            worst <= 0.4,
            device == "cuda",
        ),
    ]

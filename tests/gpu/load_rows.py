"""Rows of `tests/gpu/check.py` on how engines load: a sharded checkpoint, and vLLM's weight-transfer
engine where the node has vLLM."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

from tests.gpu.checks import Row


def sharded(tmp: Path, device: str) -> list[Row]:
    """A model saved in shards: the hf engine starts from it and loads a receiver's half that copied its
    checkpoint files (`weights.files.checkpoint_files`: the shards' index left out)."""
    import torch
    from transformers import AutoModelForCausalLM

    from astraflow import tiny
    from astraflow.engines.hf import HFEngine
    from astraflow.engines.settings import EngineSettings
    from astraflow.weights import files, layout
    from astraflow.weights.buffer import DoubleBuffer

    src = tiny.build(tmp / "for-shards", hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128)
    out = tmp / "sharded"
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.save_pretrained(out, max_shard_size="60KB")
    for f in src.iterdir():
        if not (out / f.name).exists() and not f.name.endswith(".safetensors"):
            (out / f.name).write_bytes(f.read_bytes())
    shards = len(list(out.glob("*.safetensors")))
    state = model.state_dict()
    buffer = DoubleBuffer(tmp / "sharded-half", layout.layout(state, "bfloat16"))
    buffer.add_files(files.checkpoint_files(out))
    half = buffer.write_state(state)

    async def load() -> int:
        engine = HFEngine(EngineSettings(type="hf", model=str(out), dtype="bfloat16", device=device))
        await engine.start()
        try:
            await engine.pause()
            await engine.load_weights(str(half.dir), 1)
            await engine.resume()
            return engine.version
        finally:
            await engine.close()

    try:
        version = asyncio.run(load())
    finally:
        buffer.close()
    return [
        Row(f"a sharded checkpoint ({shards} shards)", f"loads: version {version}", "loads", version == 1)
    ]


def vllm() -> list[Row]:
    """vLLM's rows need vLLM on the node; the vLLM-CPU tests (`pytest -m vllm`) cover its weight-transfer
    engine on every machine that has it."""
    if importlib.util.find_spec("vllm") is None:
        return [
            Row("vLLM takes a version via astraflow_buffer", "vllm not installed", "runs", True, judged=False)
        ]
    return [
        Row(
            "vLLM takes a version via astraflow_buffer",
            "not measured here: pytest -m vllm",
            "runs",
            True,
            judged=False,
        )
    ]

"""The LoRA rows of `tests/gpu/check.py`: a trainer step of a rank-64 adapter (attention and MLP
projections) of the Qwen2.5-7B shape on one GPU, its peak memory against 2 B/param for the bf16 base +
8 GiB and its tokens/s; and the publish-to-served time of one adapter version into an hf engine on the
same host. On the CPU dry run a tiny model stands in and the rows are shown, not judged."""

from __future__ import annotations

import asyncio
import gc
import statistics
import tempfile
import time
from pathlib import Path

from tests.gpu.checks import ACTIVATIONS_GIB, Row, gsm8k_trainer, rollout_batch, tokens_per_s

SHAPE_7B = dict(
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    vocab_size=152064,
    tie_word_embeddings=False,
)
"""Qwen2.5-7B's architecture (random weights, built on the device: nothing is fetched or written)."""
RANK = 64
PUBLISH_MS = 50.0
"""Publish-to-served of one adapter version into a same-host engine."""


def lora_settings(device: str):
    from astraflow.trainer.settings import LoraSettings

    return gsm8k_trainer(device).model_copy(update={"lora": LoraSettings(rank=RANK, alpha=2 * RANK)})


def lora_step(label: str, dims: dict, device: str, groups: int, seq: int) -> list[Row]:
    """Three steps of `PolicyTrainer` with a rank-64 LoRA of the model of `dims` (its base bf16, frozen)
    at the gsm8k recipe's settings: peak memory over all three (from before the model), tokens/s of the
    last two."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from astraflow.trainer import distributed, lora
    from astraflow.trainer.step import PolicyTrainer

    settings = lora_settings(device)
    cuda = device == "cuda"
    with torch.device(device):  # built in bf16 where it runs (no float32 copy of 7B parameters on the way)
        model = AutoModelForCausalLM.from_config(Qwen2Config(**dims), dtype=torch.bfloat16).eval()
    params = sum(p.numel() for p in model.parameters())
    if cuda:  # what the step holds and allocates, the bf16 base counted, from what was held before it
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() - 2 * params
    model = lora.wrap(model, settings.lora)
    distributed.prepare(model, settings, torch.device(device), sharded=False)
    trainer = PolicyTrainer(model, settings)
    adapter = sum(p.numel() for p in trainer.params)
    tokens = groups * 8 * seq
    batch = rollout_batch(groups, 8, seq // 4, seq - seq // 4, dims["vocab_size"])
    rate = tokens_per_s(trainer, batch, tokens, cuda)
    size = f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.0f}M"
    what = f"LoRA r{RANK} {label}, {size} base params, {adapter / 1e6:.1f}M adapter, {tokens} tokens/step"
    rows = [Row(f"trainer step {what}: tokens/s", f"{rate:,.0f} tok/s", "reference", True, judged=False)]
    limit = 2 * params / 2**30 + ACTIVATIONS_GIB
    if cuda:
        peak = (torch.cuda.max_memory_allocated() - before) / 2**30
        rows.append(
            Row(
                f"trainer step {what}: peak memory",
                f"{peak:.1f} GiB",
                f"<= 2 B/param + {ACTIVATIONS_GIB:.0f} GiB = {limit:.1f} GiB",
                peak <= limit,
            )
        )
    del trainer, model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return rows


def adapter_publish(label: str, model_dir: Path, device: str, buffers: Path) -> list[Row]:
    """The median of three versions' publish-to-served time: from the trainer's `publish` of a rank-64
    adapter of `model_dir`'s model until an hf engine on the same host (on `device`) serves it (its
    own Redis; the receiver copies the trainer's file)."""
    from astraflow import redis_server

    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory(dir=buffers) as shm:
        server = redis_server.start(Path(tmp) / "redis")
        try:
            times, nbytes = asyncio.run(_publish_to_served(model_dir, device, server.url, Path(shm)))
        finally:
            server.stop()
    ms = statistics.median(times) * 1000
    return [
        Row(
            f"publish to served, one LoRA r{RANK} version ({nbytes / 2**20:.0f} MiB) of {label}, same host",
            f"{ms:.1f} ms",
            f"<= {PUBLISH_MS:.0f} ms",
            ms <= PUBLISH_MS,
            judged=device == "cuda",
        )
    ]


async def _publish_to_served(model_dir: Path, device: str, url: str, root: Path) -> tuple[list[float], int]:
    import torch
    from transformers import AutoModelForCausalLM

    from astraflow.config import RedisSettings, StreamsSettings
    from astraflow.engines.hf import HFEngine
    from astraflow.engines.settings import EngineSettings
    from astraflow.streams import Bus
    from astraflow.trainer import distributed, lora
    from astraflow.weights import adapters, layout
    from astraflow.weights.published import run_secret
    from astraflow.weights.publisher import Adapter, WeightPublisher
    from astraflow.weights.receiver import WeightReceiver
    from astraflow.weights.server import WeightServer
    from astraflow.weights.settings import WeightsSettings

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device)
    model = lora.wrap(base, lora_settings(device).lora)
    state = distributed.publication_state(model, torch.bfloat16)
    bus = Bus.connect(url, "lora-publish", RedisSettings(), StreamsSettings())
    settings = WeightsSettings(full_every=1)
    secret = await run_secret(bus, settings)
    adapter = Adapter(adapters.base_digest(str(model_dir)), lora.adapter_config(model))
    pub = WeightPublisher(
        bus, settings, "policy", layout.layout(state, "bfloat16"), root / "trainer", secret, adapter
    )
    rx = WeightReceiver(
        bus, settings, "policy", root / "raas", secret, WeightServer(secret), model_dir=model_dir
    )
    engine = HFEngine(EngineSettings(type="hf", model=str(model_dir), dtype="bfloat16", device=device))
    await engine.start()
    times = []
    try:
        for v in range(4):
            with torch.no_grad():
                for p in model.parameters():
                    if p.requires_grad:
                        p.add_(1e-3)
            started = time.perf_counter()
            await pub.publish(state, v, step=v)
            await pub.wait()
            half = await rx.sync(bus.keys.weights("policy", v), v)
            with rx.buffer.reading(half):  # type: ignore[union-attr]
                await engine.pause()
                await engine.load_weights(str(half.dir), v)
                await engine.resume()
            if v:  # version 0 also wraps the engine's model
                times.append(time.perf_counter() - started)
        return times, layout.data_bytes(pub.specs)
    finally:
        await engine.close()
        rx.close()
        rx.server.close()
        await pub.close()
        await bus.close()

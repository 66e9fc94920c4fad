"""The rows of `tests/gpu/check.py`: each check measures one thing and returns table rows with their
pass thresholds (see `Row`). Correctness rows are judged on every device; rows whose thresholds describe
one GPU's speed or memory are judged only on CUDA (on the CPU dry run they are shown, not judged)."""

from __future__ import annotations

import asyncio
import gc
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.gpu.children import ChildError, child_error, free_port

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "gsm8k-qwen.yaml"
TFLOPS_FLOOR = 100.0
"""Model FLOP/s a trainer step must reach on one GPU: about 10% of an H100/H200's dense bf16 peak (989
TFLOP/s), which a step computing in fp32 (67 TFLOP/s peak without TF32) cannot reach."""
ACTIVATIONS_GIB = 8.0
"""Peak memory a step may use beyond its 16 B per parameter (fp32 weights, gradients, AdamW's two
moments): checkpointed activations of one 16,384-token micro-batch, autocast's bf16 weight copies, one
chunk of the lm_head's logits (`trainer.head`; the whole micro-batch's, 151,936 x 16,384 in bf16, would
be 4.6 GiB and their gradient as much again)."""


@dataclass
class Row:
    name: str
    value: str
    threshold: str
    ok: bool
    judged: bool = True
    """False: shown, not judged (a GPU's threshold on the CPU dry run, or a reference measurement)."""

    @property
    def status(self) -> str:
        if not self.judged:
            return "-" if self.threshold == "reference" else f"dry ({'ok' if self.ok else 'over'})"
        return "ok" if self.ok else "FAIL"


def child_env() -> dict[str, str]:
    """The environment for a child Python: this checkout first on PYTHONPATH, what was there kept (the
    packages check.sh installed from the carried wheels live there)."""
    kept = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(ROOT) + (os.pathsep + kept if kept else "")}


def gsm8k_trainer(device: str):
    """The gsm8k recipe's trainer settings (micro-batch tokens, bf16, gradient checkpointing, AdamW) on
    `device`."""
    import yaml

    from astraflow.trainer.settings import TrainerSettings

    data = yaml.safe_load(RECIPE.read_text())["trainer"]
    return TrainerSettings.model_validate({**data, "device": device, "devices": ""})


def rollout_batch(groups: int, samples: int, prompt: int, completion: int, vocab: int):
    """`groups` prompts x `samples` completions of fixed lengths, random tokens and advantages, as the
    dataflow hands a trainer (behaviour logprobs zero: they move the ratio, not the work)."""
    import numpy as np

    from astraflow.messages import Batch, RolloutGroup, SampleGroup, Trajectory, pack

    rng = np.random.default_rng(0)
    out = []
    for g in range(groups):
        head = rng.integers(10, vocab, prompt)
        trajs = []
        for _ in range(samples):
            tokens = np.concatenate([head, rng.integers(10, vocab, completion)]).astype(np.int32)
            mask = np.concatenate([np.zeros(prompt, np.uint8), np.ones(completion, np.uint8)])
            versions = np.where(mask == 1, 0, -1).astype(np.int32)
            trajs.append(Trajectory("policy", tokens, np.zeros(len(tokens), np.float32), mask, versions, 0.0))
        rollout = pack(RolloutGroup(uid=f"g{g}", raas="check", version=0, trajectories=trajs))
        adv = rng.standard_normal(samples).astype(np.float32)
        out.append(SampleGroup(f"g{g}", "policy", 0, 0, rollout, list(range(samples)), adv))
    return Batch(uid="policy:1", model="policy", version=0, groups=out)


def trainer_step(label: str, model_dir: Path, device: str, groups: int, seq: int) -> list[Row]:
    """Three steps of `PolicyTrainer` at the gsm8k recipe's settings on `groups` x 8 sequences of `seq`
    tokens: peak memory over all three (the first allocates AdamW's state), tokens/s of the last two."""
    import torch
    from transformers import AutoModelForCausalLM

    from astraflow.trainer import distributed
    from astraflow.trainer.step import PolicyTrainer

    settings = gsm8k_trainer(device)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    params = sum(p.numel() for p in model.parameters())
    distributed.prepare(model, settings, torch.device(device), sharded=False)
    trainer = PolicyTrainer(model, settings)
    batch = rollout_batch(groups, 8, seq // 4, seq - seq // 4, model.config.vocab_size)
    tokens = groups * 8 * seq
    cuda = device == "cuda"
    if cuda:  # what this check allocates: from what is held before it (the model: counted, it is on the GPU)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() - sum(p.numel() * p.element_size() for p in model.parameters())
    rate = tokens_per_s(trainer, batch, tokens, cuda)
    tflops = 8 * params * rate / 1e12  # forward 2N, backward 4N, the checkpointed recompute 2N per token
    limit = (16 * params) / 2**30 + ACTIVATIONS_GIB
    size = f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.0f}M"
    what = f"{label}, {size} params, {tokens} tokens/step"
    rows = [
        Row(
            f"trainer step {what}: tokens/s",
            f"{rate:,.0f} tok/s = {tflops:.1f} TFLOP/s",
            f">= {TFLOPS_FLOOR:.0f} TFLOP/s (8 x params x tok/s)",
            tflops >= TFLOPS_FLOOR,
            judged=cuda,
        )
    ]
    if cuda:
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        rows.append(
            Row(
                f"trainer step {what}: peak memory",
                f"{peak:.1f} GiB",
                f"<= 16 B/param + {ACTIVATIONS_GIB:.0f} GiB = {limit:.1f} GiB",
                peak <= limit,
            )
        )
    del trainer, model
    gc.collect()  # the trainer's closures hold it in a cycle: freed before the next check measures
    if cuda:
        torch.cuda.empty_cache()
    return rows


def tokens_per_s(trainer, batch, tokens: int, cuda: bool) -> float:
    """Three `trainer.step`s of `batch` (`tokens` tokens); the tokens/s of the last two (the first
    allocates AdamW's state), their median."""
    import torch

    times = []
    for _ in range(3):
        started = time.perf_counter()
        trainer.step(batch)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return tokens / statistics.median(times[1:])


def weight_path(label: str, model_dir: Path, device: str, buffers: Path) -> list[Row]:
    """`tests/bench/weight_path.py`'s measurement from `device`, real AdamW steps at lr 1e-6: trainer
    blocked, background and end to end of the delta version, against one copy of the served bytes (on
    CUDA: device to pinned host memory); and the delta's size after the step."""
    from tests.bench import weight_path as bench

    result = bench.run(model_dir, tokens=256, emulate=False, device=device, buffers=buffers)
    rows, sparsity, m = result["rows"], result["sparsity"], result["m"]
    delta, full = rows[2], rows[3]
    copy = "device-to-host copy (pinned)" if device == "cuda" else "host memcpy"
    gpu = device == "cuda"
    where = "/dev/shm (memory)" if buffers == Path("/dev/shm") else f"disk: {buffers} (/dev/shm had no room)"
    out = [
        Row(
            f"weight path {label}: one {copy} of the served bytes = m",
            f"{m * 1000:.0f} ms for {result['gib']:.2f} GiB ({result['gib'] / m:.1f} GiB/s)",
            "reference",
            True,
            judged=False,
        ),
        Row(f"weight path {label}: where the weight buffers went", where, "reference", True, judged=False),
    ]
    for stage, row, limit in (
        ("trainer blocked (delta)", delta["blocked"], 2),
        ("background (delta)", delta["background"], 5),
        ("end to end (delta)", delta["end to end"], 12),
        ("end to end (full)", full["end to end"], 12),
    ):
        out.append(
            Row(
                f"weight path {label}: {stage}",
                f"{row / m:.1f}m ({row * 1000:.0f} ms)",
                f"<= {limit}m",
                row <= limit * m,
                judged=gpu,
            )
        )
    smaller = sparsity["nbytes"] / max(delta["delta_bytes"], 1)
    out.append(
        Row(
            f"delta after an AdamW step at lr 1e-6, {label}",
            f"{smaller:.0f}x smaller than full ({sparsity['changed'] * 100:.2f}% of bf16 elements changed)",
            ">= 40x smaller",
            smaller >= 40,
        )
    )
    held = "holds" if sparsity["loaded"] else "does not hold"
    out.append(
        Row(
            f"weight path {label}: the engine holds the last version",
            f"{held} it in {sparsity['tensor'] or 'no tensor: the step changed none'}",
            "equal to a tensor the step changed",
            sparsity["loaded"],
        )
    )
    return out


def hf_engine(label: str, model_dir: Path, device: str, requests: int, new_tokens: int) -> list[Row]:
    """`tests/bench/hf_generate.py`'s comparison: the hf engine's concurrent requests (one batch) against one
    plain `model.generate` of the same prompts, temperature 1, medians of three alternating rounds."""
    import torch

    from astraflow.engines.base import SamplingParams
    from astraflow.engines.hf import HFEngine
    from astraflow.engines.settings import EngineSettings
    from tests.bench import hf_generate as bench

    async def measure() -> tuple[float, float]:
        dtype = "bfloat16" if device == "cuda" else "float32"
        settings = EngineSettings(
            type="hf", model=str(model_dir), device=device, dtype=dtype, max_batch=requests, max_model_len=512
        )
        engine = HFEngine(settings)
        await engine.start()
        try:
            vocab = engine.model.config.vocab_size
            g = torch.Generator().manual_seed(0)
            prompts = [torch.randint(10, vocab, (32,), generator=g).tolist() for _ in range(requests)]
            params = SamplingParams(max_new_tokens=new_tokens)
            eos = next(iter(engine.eos_ids))
            await bench.engine_round(engine, prompts[:2], params)  # warm-up
            bench.plain_round(engine.model, prompts[:2], params, engine.pad_id, eos)
            ours, plain = [], []
            for _ in range(3):
                n, s = await bench.engine_round(engine, prompts, params)
                ours.append(n / s)
                n, s = bench.plain_round(engine.model, prompts, params, engine.pad_id, eos)
                plain.append(n / s)
            return statistics.median(ours), statistics.median(plain)
        finally:
            await engine.close()

    ours, plain = asyncio.run(measure())
    return [
        Row(
            f"hf engine vs model.generate, {label}, {requests} requests x {new_tokens} tokens",
            f"{ours:,.0f} vs {plain:,.0f} tok/s = {ours / plain:.2f}x",
            ">= 0.8x",
            ours >= 0.8 * plain,
            judged=device == "cuda",
        )
    ]


def fsdp(device: str, tmp: Path, ranks: int = 1) -> list[Row]:
    """One step of FSDP2 over `ranks` ranks (NCCL on CUDA, gloo on the CPU) against one process
    (`tests/fsdp_step.py`): the fp32 parameters after it, and the bf16 tensors publication serves (with
    more than one rank, gathered from padded shards and reassembled). On CUDA with fewer GPUs than
    `ranks`, one row saying the check skipped."""
    import torch

    from astraflow import tiny
    from tests import fsdp_step

    kind = f"{ranks} {'GPU' if device == 'cuda' else 'CPU rank'}{'s' if ranks > 1 else ''}"
    name = f"FSDP2 on {kind} ({'NCCL' if device == 'cuda' else 'gloo'}) vs 1 process"
    if device == "cuda" and torch.cuda.device_count() < ranks:
        found = f"skipped: {torch.cuda.device_count()} GPU on this node"
        return [Row(name, found, f"needs {ranks} GPUs", True, judged=False)]
    model = tmp / "fsdp-model"
    if not model.exists():  # hidden 64 over 3 ranks: rows split unevenly, the last shards padded
        tiny.build(model, hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128)
    one, sharded = tmp / "one.pt", tmp / f"fsdp-{device}-{ranks}.pt"
    run = [sys.executable, "-m", "tests.fsdp_step", str(model)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks)]
    torchrun += ["--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    for cmd in ([*run, str(one), device], [*torchrun, *run[1:], str(sharded), device, "shard"]):
        done = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
        if done.returncode:
            raise ChildError(child_error(done.stdout + done.stderr))
    a, b = torch.load(one, weights_only=True), torch.load(sharded, weights_only=True)
    fp32 = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    served = torch.load(fsdp_step.served_path(sharded), weights_only=True)
    if ranks == 1:  # the same fp32 state: its bf16 cast as one process serves it, up to rounding
        reference, limit, what = torch.load(fsdp_step.served_path(one), weights_only=True), 1.0, "rounding"
    else:  # fp32 sums in another order across ranks: the gathered shards must be its own state, cast
        reference, limit, what = {k: b[k].to(torch.bfloat16) for k in served}, 0.0, "its fp32 state, cast"
    ulps = max(bf16_ulps(reference[k], served[k]) for k in reference)
    return [
        Row(f"{name}: fp32 parameters", f"max |diff| {fp32:.1e}", "<= 1e-5", fp32 <= 1e-5),
        Row(
            f"{name}: bf16 served tensors",
            f"max {ulps:.2f} bf16 ulp",
            f"<= {limit:g} ulp ({what})",
            ulps <= limit,
        ),
    ]


def bf16_ulps(a, b) -> float:
    """The largest difference of two bf16 tensors in units of bf16's spacing at the larger magnitude
    (2^-7 relative: an fp32 difference of 1e-5 may round the two copies one step apart)."""
    import torch

    a, b = a.float(), b.float()
    scale = torch.maximum(a.abs(), b.abs()).clamp(min=torch.finfo(torch.bfloat16).tiny) * 2.0**-7
    return float(((a - b).abs() / scale).max()) if a.numel() else 0.0

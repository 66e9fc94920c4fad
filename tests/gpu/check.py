"""The GPU checks, one table: `python tests/gpu/check.py [--device cuda|cpu]` (via `tests/gpu/check.sh`).

(a) a trainer step at the gsm8k recipe's settings (16,384 micro-batch tokens, bf16, gradient
    checkpointing) on the Qwen2.5-0.5B and 1.5B shapes: tokens/s and peak memory;
(b) the weight path (`tests/bench/weight_path.py`) from CUDA on the 1.5B shape: trainer blocked,
    background, end to end, against one device-to-host copy of the served bytes;
(c) the delta after a real AdamW step at lr 1e-6 on the 1.5B shape;
(d) the hf engine's generation on CUDA against a plain `model.generate` of the same requests (0.5B shape);
(e) FSDP2 on one GPU over NCCL against one process: fp32 parameters and bf16 served tensors;
(f) FSDP2 on two gloo ranks on the CPU (the publication's gather with more than one rank);
(g) FSDP2 on two GPUs over NCCL where the node has two (else a row saying it skipped);
(h) versions built on the device and taken by an hf engine in another process, 1.5B shape
    (`tests/gpu/device_rows.py`): trainer blocked, publish to served by CUDA IPC, the engine's pause,
    a version over loopback TCP with the delta applied on the device;
(i) the 7B shape's weight path alone by CUDA IPC; (j) a sharded checkpoint; (k) vLLM's row;
(l) LoRA (`tests/gpu/lora.py`): a trainer step of a rank-64 adapter of the Qwen2.5-7B shape (its bf16
    base frozen): peak memory and tokens/s; the publish-to-served time of one adapter version of the
    1.5B shape into an hf engine on the same host.

The first line names the GPU, driver, CUDA, torch and transformers; a torch outside the supported range
is refused in one line (`astraflow.trainer.torch_range`).

The shapes are random-weight models built here (`tiny.build_shape`; nothing fetched). Every row states
its threshold; the whole run must take at most 8 minutes (the last row).

`--device cpu` is a dry run on the CPU: the same code paths on a tiny model standing in for both shapes,
smaller batches; rows whose thresholds describe a GPU are shown as `dry (...)`, not judged.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from astraflow.trainer import torch_range
from tests.gpu import checks, device_rows, load_rows, lora
from tests.gpu.checks import Row
from tests.gpu.children import ChildError

LIMIT_S = 8 * 60
DRY = dict(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=704, vocab_size=512)
"""The dry run's stand-in for both shapes (`tiny.build`'s defaults): the same code, CPU-sized."""
# Per device: the trainer's batch (groups of 8 sequences, tokens per sequence), the hf engine's requests
# and new tokens. CUDA: 64 sequences of 512 tokens, two of the recipe's 16,384-token micro-batches.
SIZES = {"cuda": {"trainer": (8, 512), "generate": (32, 64)}, "cpu": {"trainer": (1, 64), "generate": (4, 8)}}
DRY_CONFIG = dict(
    hidden_size=DRY["hidden"],
    intermediate_size=DRY["intermediate"],
    num_hidden_layers=DRY["layers"],
    num_attention_heads=DRY["heads"],
    num_key_value_heads=DRY["kv_heads"],
    vocab_size=DRY["vocab_size"],
)
"""The dry run's stand-in for the 7B shape of the LoRA step (`lora.SHAPE_7B`)."""


def build(tmp: Path, device: str) -> dict[str, tuple[str, Path]]:
    """The models by role: `small` (0.5B shape), `large` (1.5B shape); on the CPU one tiny model for both."""
    from astraflow import tiny

    if device == "cpu":
        path = tiny.build(tmp / "tiny", **DRY)
        return {"small": ("tiny for qwen2.5-0.5b", path), "large": ("tiny for qwen2.5-1.5b", path)}
    return {
        "small": ("qwen2.5-0.5b", tiny.build_shape(tmp / "small", "qwen2.5-0.5b")),
        "large": ("qwen2.5-1.5b", tiny.build_shape(tmp / "large", "qwen2.5-1.5b")),
    }


def torch_version() -> str:
    """The torch under test (`ASTRAFLOW_CHECK_TORCH_VERSION` stands in for it: the refusal's test)."""
    import torch

    return os.environ.get("ASTRAFLOW_CHECK_TORCH_VERSION", torch.__version__)


def stack() -> str:
    """One line: the GPU, its driver, CUDA, torch and transformers."""
    import torch
    import transformers

    gpu, driver = "none", "none"
    if torch.cuda.is_available():
        total = torch.cuda.mem_get_info()[1]
        gpu = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()} ({total / 2**30:.0f} GiB)"
    if shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        done = subprocess.run(query, capture_output=True, text=True)
        driver = done.stdout.splitlines()[0].strip() if done.returncode == 0 and done.stdout else "unknown"
    return (
        f"gpu {gpu}, driver {driver}, cuda {torch.version.cuda or 'none'}, torch {torch_version()},"
        f" transformers {transformers.__version__}"
    )


def buffers_dir(tmp: Path, need: int) -> Path:
    """/dev/shm when it has room for `need` bytes (containers often give it 64 MiB), else `tmp`."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and shutil.disk_usage(shm).free >= need else tmp


def attempt(rows: list[Row], name: str, fn, *args) -> None:
    """`fn`'s rows, or one FAIL row naming the error: the other checks still report."""
    try:
        rows.extend(fn(*args))
    except ChildError as e:  # the child's own exception, already one line
        rows.append(Row(name, f"error: {e}", "runs", False))
    except Exception as e:
        rows.append(Row(name, f"error: {e!r}"[:300].replace("\n", " | "), "runs", False))


def table(rows: list[Row]) -> str:
    head = ("check", "measured", "threshold", "")
    cells = [head, *((r.name, r.value, r.threshold, r.status) for r in rows)]
    widths = [max(len(c[i]) for c in cells) for i in range(3)]
    return "\n".join("  ".join(c[i].ljust(widths[i]) for i in range(3)) + "  " + c[3] for c in cells).rstrip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = ap.parse_args()
    device, sizes = args.device, SIZES[args.device]
    started = time.perf_counter()
    print(stack())
    refused = torch_range.refusal(torch_version())
    if refused is not None:
        print(f"refused: {refused}")
        return 2
    if device == "cpu":
        dims = ", ".join(f"{k} {v}" for k, v in DRY.items())
        print(f"dry run on the cpu: a tiny model ({dims}) stands in for qwen2.5-0.5b and qwen2.5-1.5b")
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="astraflow-gpu-") as t:
        tmp = Path(t)
        models = build(tmp, device)
        print(f"models built in {time.perf_counter() - started:.0f} s", flush=True)
        for role in ("small", "large"):
            label, path = models[role]
            step = checks.trainer_step
            attempt(rows, f"trainer step {label}", step, label, path, device, *sizes["trainer"])
        label, path = models["large"]
        need = 8 * sum(f.stat().st_size for f in path.glob("*.safetensors")) // 2  # served bf16 x 8
        attempt(rows, f"weight path {label}", checks.weight_path, label, path, device, buffers_dir(tmp, need))
        buffers = buffers_dir(tmp, need)
        attempt(rows, f"on the device {label}", device_rows.device_path, label, path, device, tmp, buffers)
        dims = device_rows.QWEN_7B if device == "cuda" else DRY
        seven = buffers_dir(tmp, 32 << 30 if device == "cuda" else 1 << 30)  # two 15 GB halves at 7B
        attempt(rows, "on the device 7B shape", device_rows.seven_b, device, tmp, seven, dims)
        attempt(rows, "a sharded checkpoint", load_rows.sharded, tmp, device)
        rows.extend(load_rows.vllm())
        label, path = models["small"]
        attempt(rows, f"hf engine {label}", checks.hf_engine, label, path, device, *sizes["generate"])
        attempt(rows, "FSDP2 vs 1 process", checks.fsdp, device, tmp)
        # Two gloo ranks on the CPU (every node): the publication's padded gather and reassembly.
        attempt(rows, "FSDP2 on 2 CPU ranks vs 1 process", checks.fsdp, "cpu", tmp, 2)
        if device == "cuda":  # a one-GPU node says it skipped
            attempt(rows, "FSDP2 on 2 GPUs vs 1 process", checks.fsdp, "cuda", tmp, 2)
        dims, label = (
            (lora.SHAPE_7B, "qwen2.5-7b") if device == "cuda" else (DRY_CONFIG, "tiny for qwen2.5-7b")
        )
        attempt(rows, f"LoRA trainer step {label}", lora.lora_step, label, dims, device, *sizes["trainer"])
        label, path = models["large"]
        attempt(
            rows,
            f"LoRA publish {label}",
            lora.adapter_publish,
            label,
            path,
            device,
            buffers_dir(tmp, 1 << 30),
        )
    wall = time.perf_counter() - started
    rows.append(Row("the whole check", f"{wall:.0f} s", f"<= {LIMIT_S} s", wall <= LIMIT_S, device == "cuda"))
    print()
    print(table(rows))
    judged = [r for r in rows if r.judged]
    failed = [r.name for r in judged if not r.ok]
    verdict = f"FAIL {failed}" if failed else "all ok"
    print(f"\n{len(judged)} rows judged: {verdict} ({len(rows) - len(judged)} shown only)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

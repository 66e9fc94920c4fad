"""The GPU checks, one table: `python tests/gpu/check.py [--device cuda|cpu] [--loop-s S]`.

1. The default recipe's whole loop (hf engine and trainer on the device) until reward 0.8 or `--loop-s`,
   against the same run on the CPU: time and steps to the target.
2. FSDP2 on one device (NCCL on CUDA) against one process: the parameters after one step.
3. Publication's host copy: a 1B-parameter bf16 state copied to pinned host memory (`devices.to_host`).

`--device cpu` runs the same checks on the CPU (a dry run of the script; check 1 then runs once).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def loop(device: str, run_dir: Path, limit_s: int) -> dict:
    """`astraflow run` of the default recipe with engine and trainer on `device`; its summary."""
    sets = [
        f"run.dir={run_dir}",
        "engine.type=hf",
        f"engine.device={device}",
        f"trainer.device={device}",
        f"run.max_time_s={limit_s}",
    ]
    cmd = [
        sys.executable,
        "-m",
        "astraflow.cli",
        "run",
        "recipes/addition-tiny.yaml",
        "--run",
        f"gpu-{device}",
    ]
    for s in sets:
        cmd += ["--set", s]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=limit_s + 240)
    if done.returncode not in (0, 3):  # 3: the time limit came before the reward target (still a report)
        return {"error": (done.stdout + done.stderr)[-800:]}
    return json.loads((run_dir / "summary.json").read_text())


def fsdp(device: str, tmp: Path) -> str:
    """Max abs difference of the parameters after one step: FSDP2 on one rank vs one process."""
    import torch

    from astraflow import tiny

    model = tiny.build(tmp / "tiny", hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128)
    one, sharded = tmp / "one.pt", tmp / "fsdp.pt"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run(
        [sys.executable, "-m", "tests.fsdp_step", str(model), str(one), device], cwd=ROOT, env=env, check=True
    )
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1"]
    subprocess.run(
        [*torchrun, "-m", "tests.fsdp_step", str(model), str(sharded), device, "shard"],
        cwd=ROOT,
        env=env,
        check=True,
    )
    a, b = torch.load(one, weights_only=True), torch.load(sharded, weights_only=True)
    diff = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    return f"max |diff| {diff:.2e} ({'ok' if diff <= 1e-5 else 'MISMATCH'})"


def host_copy(device: str, params: float) -> str:
    """Time `devices.to_host` of a bf16 state of `params` parameters on `device`."""
    import torch

    from astraflow.trainer import devices

    chunk = 64 * 1024 * 1024
    n = int(params)
    state = {
        f"w{i}": torch.ones(min(chunk, n - i * chunk), dtype=torch.bfloat16, device=device)
        for i in range(-(-n // chunk))
    }
    devices.to_host(state)  # warm: pinned allocations, CUDA context
    t0 = time.perf_counter()
    host = devices.to_host(state)
    dt = time.perf_counter() - t0
    assert all(v.device.type == "cpu" for v in host.values())
    gb = n * 2 / 1e9
    return f"{n / 1e9:.2f}B params ({gb:.1f} GB): {dt:.2f} s, {gb / dt:.1f} GB/s"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--loop-s", type=int, default=150, help="each loop run's time limit")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="astraflow-gpu-") as t:
        tmp = Path(t)
        runs = {d: loop(d, tmp / d, args.loop_s) for d in dict.fromkeys([args.device, "cpu"])}
        for d, s in runs.items():
            if "error" in s:
                rows.append((f"loop on {d}", "FAILED: " + s["error"].replace("\n", " | ")))
            else:
                steps = s["models"]["policy"]["versions"]
                rows.append((f"loop on {d}", f"{s['stopped']}; {s['wall_s']} s, {steps} steps"))
        try:
            rows.append((f"FSDP2 1 rank vs 1 process ({args.device})", fsdp(args.device, tmp)))
        except Exception as e:  # a table row, not a traceback: the other checks still report
            rows.append((f"FSDP2 1 rank vs 1 process ({args.device})", f"FAILED: {e!r}"))
    params = 1e9 if args.device == "cuda" else 1e8
    rows.append((f"host copy of a bf16 state ({args.device})", host_copy(args.device, params)))
    width = max(len(r[0]) for r in rows)
    print(f"\n{'check':<{width}}  result")
    for name, result in rows:
        print(f"{name:<{width}}  {result}")
    return 0 if not any("FAILED" in r[1] or "MISMATCH" in r[1] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

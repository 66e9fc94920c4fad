"""What evaluation as a service costs a run: the default recipe for a fixed number of steps with its eval
(`eval.every` of the recipe) against the same run with `eval.every=0` (the baseline), in one invocation,
alternating, so the machine's noise falls on both.

Per arm and seed: wall time of the run, steps, the on-policy reward of the last window, groups dropped
as stale (an eval holds later versions back, so rollouts of the held version age), eval groups scored, and
the eval results' first and last value. The ratio is of median wall times, against the baseline.

    python tests/bench/eval_overhead.py [--steps 150] [--seeds 0] [--every 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _smoke import parse


def run(every: int, seed: int, root: Path, steps: int) -> dict:
    out = root / f"every{every}-{seed}"
    cmd = [sys.executable, "-m", "astraflow.cli", "run", "recipes/addition-tiny.yaml", "--run", f"ev{every}"]
    sets = [f"run.dir={out}", f"run.seed={seed}", "run.target_reward=null", f"run.max_steps={steps}"]
    for s in [*sets, f"eval.every={every}"]:
        cmd += ["--set", s]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=1800)
    data = json.loads((out / "summary.json").read_text())
    dropped = data["ledger"]["models"]["policy"]["dropped"]
    evals = [e.get("pass@1") for e in data["evals"]]
    return {
        "wall_s": data["wall_s"],
        "steps": data["models"]["policy"]["versions"],
        "reward": data["models"]["policy"]["reward_last_window"],
        "stale": dropped.get("stale_ingest", 0) + dropped.get("stale_wait", 0),
        "eval_groups": data["ledger"]["eval"],
        "eval": f"{evals[0]:.2f} -> {evals[-1]:.2f}" if evals else "-",
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--seeds", default="0")
    p.add_argument("--every", type=int, default=10)
    args = parse(p, steps=2, every=1)
    results: dict[int, list[dict]] = {0: [], args.every: []}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in (int(s) for s in args.seeds.split(",")):
            for every in results:
                results[every].append(run(every, seed, Path(tmp), args.steps))
    base = statistics.median(r["wall_s"] for r in results[0])
    head = ("eval.every", "wall_s", "ratio", "steps", "reward", "stale", "evals")
    print(" ".join(f"{h:>10}" for h in head), " eval")
    for every, rows in results.items():
        for r in rows:
            cells = (
                every,
                f"{r['wall_s']:.1f}",
                f"{r['wall_s'] / base:.2f}",
                r["steps"],
                f"{r['reward']:.3f}",
            )
            cells += (r["stale"], r["eval_groups"])
            print(" ".join(f"{c:>10}" for c in cells), "", r["eval"])


if __name__ == "__main__":
    main()

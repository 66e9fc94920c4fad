"""What evaluation as a service costs a run: the default recipe for a fixed number of steps with its eval
(the recipe's cadence: `eval.every_s`) and with an eval every `--every` versions (the cadence before it),
against the same run without any eval (the baseline), in one invocation, alternating, so the machine's
noise falls on all three.

Per arm and seed: wall time of the run, steps, the on-policy reward of the last window, groups dropped
as stale (an eval holds later versions back, so rollouts of the held version age), eval groups scored,
the eval results' first and last value, and `held`: the share of the wall time the evals held later
versions back (from each eval's submission to the next notice). The ratio is of median wall times,
against the baseline.

    python tests/bench/eval_overhead.py [--steps 150] [--seeds 0] [--every 10]

The last line: `eval overhead: recipe <r>, every <n> versions <r> (<seeds> seeds)`, each the ratio of
median wall times against the baseline (1.03: the eval costs 3% of the run's time).
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


def run(arm: str, evals: list[str], seed: int, root: Path, steps: int) -> dict:
    out = root / f"{arm.replace(' ', '')}-{seed}"
    cmd = [sys.executable, "-m", "astraflow.cli", "run", "recipes/addition-tiny.yaml", "--run", "evbench"]
    sets = [f"run.dir={out}", f"run.seed={seed}", "run.target_reward=null", f"run.max_steps={steps}"]
    for s in [*sets, *evals]:
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
        "held_s": held_s(out / "logs" / "dataflow.log"),
    }


def held_s(log: Path) -> float:
    """Seconds the evals held the notices back: from each eval's submission to the next notice (the
    dataflow's `version_announced` lines say `eval_held_s`)."""
    lines = (json.loads(x) for x in log.read_text().splitlines() if x.startswith("{"))
    return sum(e.get("eval_held_s", 0.0) for e in lines if e.get("event") == "version_announced")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--seeds", default="0")
    p.add_argument("--every", type=int, default=10)
    args = parse(p, steps=2, every=1)
    arms = {
        "none": ["eval.every=0", "eval.every_s=0"],
        "recipe": [],
        f"every {args.every}": [f"eval.every={args.every}", "eval.every_s=0"],
    }
    results: dict[str, list[dict]] = {arm: [] for arm in arms}
    seeds = [int(s) for s in args.seeds.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            for arm, evals in arms.items():
                results[arm].append(run(arm, evals, seed, Path(tmp), args.steps))
    base = statistics.median(r["wall_s"] for r in results["none"])
    ratio = {arm: statistics.median(r["wall_s"] for r in rows) / base for arm, rows in results.items()}
    head = ("eval", "wall_s", "ratio", "steps", "reward", "stale", "evals", "held")
    print(" ".join(f"{h:>10}" for h in head), " eval")
    for arm, rows in results.items():
        for r in rows:
            cells = (
                arm,
                f"{r['wall_s']:.1f}",
                f"{r['wall_s'] / base:.2f}",
                r["steps"],
                f"{r['reward']:.3f}",
            )
            cells += (r["stale"], r["eval_groups"], f"{r['held_s'] / r['wall_s']:.1%}")
            print(" ".join(f"{c:>10}" for c in cells), "", r["eval"])
    every = f"every {args.every}"
    print(f"eval overhead: recipe {ratio['recipe']:.2f}, {every} versions {ratio[every]:.2f}", end=" ")
    print(f"({len(seeds)} seeds)")


if __name__ == "__main__":
    main()

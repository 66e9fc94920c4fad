"""What evaluation as a service costs a run: the default recipe with its eval (the recipe's cadence:
`eval.every_s`) and with an eval every `--every` versions (the cadence before it), against the same run
without any eval (the baseline), in one invocation, alternating, so the machine's noise falls on all.
Each run lasts a fixed number of steps, or with `--target` until the on-policy reward reaches it (the
time to target; capped at `--max-time`).

Per arm and seed: wall time of the run, steps, the on-policy reward of the last window, groups dropped
as stale (an eval holds later versions back, so rollouts of the held version age), eval groups scored,
the eval results' first and last value, `held`: the share of the wall time the evals held later
versions back (from each eval's submission to the next notice), `gen`: the evals' share of the samples
generated, and `priced`: the two added, a bound on the eval's share of the run (the eval costs the run
time only by holding versions back and by the engine time its rows take; counted apart, they may
overlap). The ratio is of median wall times, against the baseline.

    python tests/bench/eval_overhead.py [--steps 150 | --target 0.8] [--seeds 0] [--every 10] [--arms ...]

Then `eval priced: recipe <p>% of the run (held <h>%, generation <g>%)` (each the median over the
recipe's runs), and the
last line: `eval overhead: recipe <r>, every <n> versions <r> (<seeds> seeds)`, each the ratio of median
wall times against the baseline (1.03: the eval costs 3% of the run's time), `-` for an arm not run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml
from _smoke import parse


def run(arm: str, evals: list[str], seed: int, root: Path, length: list[str]) -> dict:
    out = root / f"{arm.replace(' ', '')}-{seed}"
    cmd = [sys.executable, "-m", "astraflow.cli", "run", "recipes/addition-tiny.yaml", "--run", "evbench"]
    for s in [f"run.dir={out}", f"run.seed={seed}", *length, *evals]:
        cmd += ["--set", s]
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, timeout=3600)
    if done.returncode not in (0, 3):  # (3: a limit reached before the target)
        raise SystemExit(f"{arm} seed {seed}: astraflow run exited {done.returncode}")
    data = json.loads((out / "summary.json").read_text())
    settings = yaml.safe_load((out / "settings.yaml").read_text())
    ledger = data["ledger"]
    dropped = ledger["models"]["policy"]["dropped"]
    evals = [e.get("pass@1") for e in data["evals"]]
    eval_samples = ledger["eval"] * settings["eval"]["n_samples"]
    samples = ledger["models"]["policy"]["collected"] * settings["dataflow"]["feeder"]["n_samples"]
    return {
        "wall_s": data["wall_s"],
        "reached": data["stopped"].startswith("reward target"),
        "steps": data["models"]["policy"]["versions"],
        "reward": data["models"]["policy"]["reward_last_window"],
        "stale": dropped.get("stale_ingest", 0) + dropped.get("stale_wait", 0),
        "eval_groups": ledger["eval"],
        "eval": f"{evals[0]:.2f} -> {evals[-1]:.2f}" if evals else "-",
        "held_s": held_s(out / "logs" / "dataflow.log"),
        "gen": eval_samples / max(eval_samples + samples, 1),
    }


def held_s(log: Path) -> float:
    """Seconds the evals held the notices back: from each eval's submission to the next notice (the
    dataflow's `version_announced` lines say `eval_held_s`)."""
    lines = (json.loads(x) for x in log.read_text().splitlines() if x.startswith("{"))
    return sum(e.get("eval_held_s", 0.0) for e in lines if e.get("event") == "version_announced")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--target", type=float, default=None, help="run each until this on-policy reward")
    p.add_argument("--max-time", type=int, default=900, help="with --target: seconds at most per run")
    p.add_argument("--seeds", default="0")
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--arms", default="none,recipe,every", help="which of none, recipe, every to run")
    args = parse(p, steps=2, every=1)
    every = f"every {args.every}"
    arms = {
        "none": ["eval.every=0", "eval.every_s=0"],
        "recipe": [],
        every: [f"eval.every={args.every}", "eval.every_s=0"],
    }
    chosen = {a.strip() for a in args.arms.split(",")}
    arms = {arm: sets for arm, sets in arms.items() if arm.split()[0] in chosen | {"none"}}
    if args.target is None:
        length = ["run.target_reward=null", f"run.max_steps={args.steps}"]
    else:
        length = [f"run.target_reward={args.target}", f"run.max_time_s={args.max_time}"]
    results: dict[str, list[dict]] = {arm: [] for arm in arms}
    seeds = [int(s) for s in args.seeds.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            for arm, evals in arms.items():
                results[arm].append(run(arm, evals, seed, Path(tmp), length))
    base = statistics.median(r["wall_s"] for r in results["none"])
    ratio = {arm: statistics.median(r["wall_s"] for r in rows) / base for arm, rows in results.items()}
    head = ("eval", "wall_s", "ratio", "steps", "reward", "stale", "evals", "held", "gen", "priced")
    print(" ".join(f"{h:>10}" for h in head), " eval")
    for arm, rows in results.items():
        for r in rows:
            wall = f"{r['wall_s']:.1f}" + ("" if r["reached"] or args.target is None else "+")
            cells = (arm, wall, f"{r['wall_s'] / base:.2f}", r["steps"], f"{r['reward']:.3f}", r["stale"])
            held = r["held_s"] / r["wall_s"]
            cells += (r["eval_groups"], f"{held:.1%}", f"{r['gen']:.1%}", f"{held + r['gen']:.1%}")
            print(" ".join(f"{c:>10}" for c in cells), "", r["eval"])
    if args.target is not None and not all(r["reached"] for rows in results.values() for r in rows):
        print(f"(+: the target {args.target} was not reached within {args.max_time} s)")
    if "recipe" in results:
        rows = results["recipe"]
        held = statistics.median(r["held_s"] / r["wall_s"] for r in rows)
        gen = statistics.median(r["gen"] for r in rows)
        priced = statistics.median(r["held_s"] / r["wall_s"] + r["gen"] for r in rows)
        print(f"eval priced: recipe {priced:.1%} of the run (held {held:.1%}, generation {gen:.1%})")
    shown = {arm: f"{ratio[arm]:.2f}" if arm in ratio else "-" for arm in ("recipe", every)}
    print(f"eval overhead: recipe {shown['recipe']}, {every} versions {shown[every]} ({len(seeds)} seeds)")


if __name__ == "__main__":
    main()

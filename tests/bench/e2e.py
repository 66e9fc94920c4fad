"""End to end: the default recipe in async and in sync mode (same seed), one after the other.

For each mode: time from launch to the reward target (moving average of the on-policy reward), trained
samples/s between the first and the last trainer step, and where the wall time went: generation (the
RaaS's generating seconds, from its heartbeats: time with at least one prompt group being rolled out)
and training (the trainer's `step_s`: forward, backward, optimizer).

Overlap efficiency = speedup / ideal, where speedup = async samples/s / sync samples/s and
ideal = (t_gen + t_train) / max(t_gen, t_train) from the sync run's own per-step timings: what perfect
overlap of the two would buy over lockstep, with no other cost. Overhead = the share of the sync run's
wall time outside generation and training (checkpoint, weight publication and load, hand-offs); for the
async run, 1 - max(generation share, training share) bounds the time when neither was busy from above.

    python tests/bench/e2e.py [--recipe recipes/addition-tiny.yaml] [--max-time 1200] [--modes async,sync]
    python tests/bench/e2e.py --report ROOT   # the figures again, of the runs an invocation kept in ROOT
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime
from pathlib import Path


def stages(log_dir: Path) -> dict[str, float]:
    """Median milliseconds per version between the events of its round trip, from the processes' logs:
    trained -> announced (checkpoint, buffer write, barrier) -> loaded by the RaaS -> next batch formed."""
    at: dict[tuple[str, int], float] = {}
    for path in log_dir.glob("*.log"):
        for text in path.read_text().splitlines():
            if not text.startswith("{"):
                continue
            e = json.loads(text)
            event, version = e.get("event"), e.get("version")
            if event == "batch_formed":
                event, version = "formed", int(e["batch"].rsplit(":", 1)[1])
            if event in ("trained", "version_announced", "weights_loaded", "formed") and version is not None:
                at.setdefault((event, version), datetime.fromisoformat(e["timestamp"]).timestamp())
    legs = {"trained->announced": [], "announced->loaded": [], "loaded->next batch formed": []}
    for (event, v), t in at.items():
        if event != "trained" or ("version_announced", v) not in at or ("weights_loaded", v) not in at:
            continue
        if ("formed", v + 1) not in at:
            continue
        announced, loaded = at["version_announced", v], at["weights_loaded", v]
        legs["trained->announced"].append(announced - t)
        legs["announced->loaded"].append(loaded - announced)
        legs["loaded->next batch formed"].append(at["formed", v + 1] - loaded)
    return {k: 1000 * statistics.median(v) for k, v in legs.items() if v}


def run(recipe: str, mode: str, root: Path, max_time: float, target: float) -> dict:
    """One `astraflow run` of `recipe` in `mode` until its target or `max_time`; its figures."""
    run_dir = root / mode
    cmd = [sys.executable, "-m", "astraflow.cli", "run", recipe, "--run", f"bench-{mode}"]
    for s in (f"run.dir={run_dir}", f"trainer.mode={mode}", f"run.max_time_s={max_time}"):
        cmd += ["--set", s]
    print(f"{mode}: {' '.join(cmd[2:])}", flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=max_time + 300)
    return figures(run_dir, mode, target)


def figures(run_dir: Path, mode: str, target: float) -> dict:
    """The figures of a finished run in `run_dir`."""
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (name, model), *_ = summary["models"].items()
    steps = [s for s in steps if s["model"] == name]
    window = 10
    reached = None
    for i in range(window - 1, len(steps)):
        if sum(s["rollout_reward"] for s in steps[i - window + 1 : i + 1]) / window >= target:
            reached = steps[i]["wall_s"]
            break
    span = model["last_step_s"] - model["first_step_s"]
    n = len(steps)
    return {
        "mode": mode,
        "stopped": summary["stopped"],
        "steps": n,
        "time_to_target_s": reached,
        "samples_per_s": model["samples_per_s"],
        "t_gen": summary["generating_s"] / n,
        "t_train": model["train_s"] / n,
        "t_step": span / max(n - 1, 1),
        "gen_share": summary["generating_s"] / span,
        "train_share": model["train_s"] / span,
        "reward_last": model["reward_last_window"],
        "early_rise": _mean(steps[130:150]) - _mean(steps[:10]) if n >= 150 else None,
        "stages_ms": stages(run_dir / "logs"),
        "eval_last": summary["evals"][-1][2] if summary["evals"] else None,
    }


def _mean(steps: list[dict]) -> float:
    return sum(s["rollout_reward"] for s in steps) / len(steps)


def main() -> None:
    modes = args.modes.split(",")
    if args.report:  # the figures of runs an earlier invocation kept
        root = Path(args.report)
        results = {m: figures(root / m, m, args.target) for m in modes}
    else:
        root = Path(tempfile.mkdtemp(prefix="astraflow-bench-e2e-"))
        results = {m: run(args.recipe, m, root, args.max_time, args.target) for m in modes}
    print(f"\n{args.recipe}: target reward {args.target} (ma10), at most {args.max_time:.0f} s per mode")
    head = ("steps", "to target", "samples/s", "t_gen", "t_train", "t_step")
    print(f"{'mode':6} " + " ".join(f"{h:>10}" for h in head))
    for r in results.values():
        to = f"{r['time_to_target_s']:.0f}s" if r["time_to_target_s"] is not None else "not reached"
        print(
            f"{r['mode']:6} {r['steps']:10d} {to:>10} {r['samples_per_s']:10.0f} {r['t_gen']:10.3f}"
            f" {r['t_train']:10.3f} {r['t_step']:10.3f}   (stopped: {r['stopped']}; reward"
            f" {r['reward_last']:.3f}, eval {r['eval_last']})"
        )
    for r in results.values():
        rise = "-" if r["early_rise"] is None else f"{r['early_rise']:+.3f}"
        print(f"{r['mode']}: reward of steps 131-150 minus steps 1-10 {rise}")
    if "sync" in results:  # lockstep: one version's round trip, leg by leg
        legs = ", ".join(f"{k} {v:.1f} ms" for k, v in results["sync"]["stages_ms"].items())
        print(f"sync, median per version: {legs}")
    if {"async", "sync"} <= results.keys():
        a, s = results["async"], results["sync"]
        speedup = a["samples_per_s"] / s["samples_per_s"]
        ideal = (s["t_gen"] + s["t_train"]) / max(s["t_gen"], s["t_train"])
        efficiency = speedup / ideal
        print(f"speedup async/sync {speedup:.2f}, ideal {ideal:.2f}, overlap efficiency {efficiency:.2f}")
        print(f"overhead (sync): {1 - (s['t_gen'] + s['t_train']) / s['t_step']:.0%} of wall time")
        print(
            f"async: generating {a['gen_share']:.0%}, training {a['train_share']:.0%} of wall time; overhead"
            f" at most {1 - max(a['gen_share'], a['train_share']):.0%}"
        )
        if a["time_to_target_s"] and s["time_to_target_s"]:
            print(f"time to target sync/async: {s['time_to_target_s'] / a['time_to_target_s']:.2f}")
    print(f"runs kept in {root}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", default="recipes/addition-tiny.yaml")
    parser.add_argument("--max-time", type=float, default=1200.0)
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--modes", default="async,sync")
    parser.add_argument("--report", metavar="ROOT", help="print the figures of the runs kept in ROOT")
    args = parser.parse_args()
    main()

"""End to end: time to the reward target of the default recipe, astraflow against a plain loop.

Three contenders, each run to the target (10-step moving average of the on-policy reward >= 0.8) once per
seed, in one invocation, one run at a time, in turn (so the machine's noise falls on all of them):
- `plain`: tests/bench/plain_loop.py, a synchronous in-process GRPO loop on every core (the baseline);
- `async`: `astraflow run` (dataflow, RaaS and trainer processes on an embedded Redis);
- `sync`: `astraflow run --set trainer.mode=sync` (the same processes in lockstep, staleness 0).

Per contender: median time to target (from process start: imports, model load and process start-up
count), steps to target, wall time per step, and where a step's time goes. Plain: generation and
training. astraflow, from the trainer's side (it is the loop's clock): training (forward, backward,
optimizer), waiting for a batch, and the trainer's own work (batch fetch, weight publication, checkpoints,
metrics); generation is the RaaS's generating time per step (time with a prompt group in flight), which
overlaps the others in async mode. `cpu` is each process's CPU share of the wall time (dataflow,
Redis and launcher: the system's own work), with the Redis commands per step. Ratios are of median
times to target, against plain.

    python tests/bench/e2e.py [--seeds 0,1,2] [--contenders plain,async,sync] [--max-time 900]
                              [--max-steps N]
    python tests/bench/e2e.py --report ROOT   # the table again, from the runs an invocation kept in ROOT
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

BENCH = Path(__file__).parent


def run(contender: str, seed: int, root: Path) -> None:
    """One run of `contender` with `seed`, its files in `root/<contender>-<seed>`."""
    out = root / f"{contender}-{seed}"
    if contender == "plain":
        out.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, str(BENCH / "plain_loop.py"), "--recipe", args.recipe, "--seed", str(seed)]
        cmd += ["--max-time", str(args.max_time), "--json", str(out / "plain.json")]
        cmd += ["--max-steps", str(args.max_steps)] if args.max_steps else []
    else:
        cmd = [sys.executable, "-m", "astraflow.cli", "run", args.recipe, "--run", f"bench-{contender}"]
        for s in (f"run.dir={out}", f"run.seed={seed}", f"trainer.mode={contender}"):
            cmd += ["--set", s]
        cmd += ["--set", f"run.max_time_s={args.max_time}"]
        cmd += ["--set", f"run.max_steps={args.max_steps}"] if args.max_steps else []
    print(f"{contender} seed {seed}: {' '.join(cmd[1:])}", flush=True)
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, timeout=args.max_time + 300)
    if done.returncode not in (0, 3):  # 3: the time limit came before the target (its figures say so)
        raise subprocess.CalledProcessError(done.returncode, cmd)


def figures(contender: str, seed: int, root: Path) -> dict:
    """What one kept run measured; times in seconds, per-step figures in milliseconds."""
    out = root / f"{contender}-{seed}"
    if contender == "plain":
        data = json.loads((out / "plain.json").read_text())
        steps = data["steps"]
        n = len(steps)
        return {
            "to_target_s": data["time_to_target_s"],
            "steps": n,
            "step_ms": 1000 * (steps[-1]["wall_s"] - steps[0]["wall_s"]) / max(n - 1, 1),
            "gen_ms": 1000 * statistics.mean(s["gen_s"] for s in steps),
            "train_ms": 1000 * statistics.mean(s["train_s"] for s in steps),
        }
    summary = json.loads((out / "summary.json").read_text())
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    model = next(iter(summary["models"]))
    steps = [s for s in steps if s["model"] == model]
    n, window, reached = len(steps), args.window, None
    for i in range(window - 1, n):
        if sum(s["rollout_reward"] for s in steps[i - window + 1 : i + 1]) / window >= args.target:
            reached = steps[i]["wall_s"]
            break
    span = steps[-1]["wall_s"] - steps[0]["wall_s"]
    step_ms = 1000 * span / max(n - 1, 1)
    train_ms = 1000 * statistics.mean(s["step_s"] for s in steps[1:])
    wait_ms = 1000 * statistics.mean(s.get("wait_s", 0.0) for s in steps[1:])
    wall = summary["wall_s"]
    return {
        "to_target_s": reached,
        "steps": n,
        "step_ms": step_ms,
        "gen_ms": 1000 * summary["generating_s"] / n,
        "train_ms": train_ms,
        "wait_ms": wait_ms,
        "own_ms": step_ms - train_ms - wait_ms,
        "cpu": {name: c / wall for name, c in summary.get("cpu_s", {}).items()},
        "redis_per_step": summary.get("redis_commands", 0) / n,
    }


def report(results: dict[str, list[dict]]) -> None:
    print(f"\n{args.recipe}: to reward {args.target} (ma{args.window}), medians over seeds {args.seeds}")
    head = ("to target", "steps", "ms/step", "gen", "train", "wait", "own")
    print(f"{'':8}" + "".join(f"{h:>11}" for h in head) + "   runs (time to target)")
    medians = {}
    for c, runs in results.items():
        times = [r["to_target_s"] if r["to_target_s"] is not None else float("inf") for r in runs]
        medians[c] = statistics.median(times)
        cells = [f"{medians[c]:.0f}s" if medians[c] != float("inf") else "not reached"]
        for k in ("steps", "step_ms", "gen_ms", "train_ms", "wait_ms", "own_ms"):
            values = [r[k] for r in runs if k in r]
            cells.append(f"{statistics.median(values):.0f}" if values else "-")
        each = ", ".join("-" if t == float("inf") else f"{t:.0f}s" for t in times)
        print(f"{c:8}" + "".join(f"{x:>11}" for x in cells) + f"   {each}")
    for c, runs in results.items():
        if c != "plain":
            names = sorted({n for r in runs for n in r["cpu"]})
            share = {n: statistics.median(r["cpu"].get(n, 0) for r in runs) for n in names}
            shares = ", ".join(f"{n} {v:.0%}" for n, v in share.items())
            commands = statistics.median(r["redis_per_step"] for r in runs)
            print(f"{c} cpu: {shares}; {commands:.0f} Redis commands per step")
    if "plain" in medians:
        for c in medians.keys() - {"plain"}:
            ratio = medians[c] / medians["plain"]
            print(f"{c}/plain time to target: {ratio:.2f}" if ratio != float("inf") else f"{c}: not reached")


def main() -> None:
    contenders, seeds = args.contenders.split(","), [int(s) for s in args.seeds.split(",")]
    root = Path(args.report or tempfile.mkdtemp(prefix="astraflow-bench-e2e-"))
    if not args.report:
        for seed in seeds:
            for c in contenders:
                run(c, seed, root)
    results = {c: [figures(c, s, root) for s in seeds] for c in contenders}
    (root / "results.json").write_text(json.dumps(results, indent=1))
    report(results)
    print(f"runs kept in {root}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", default="recipes/addition-tiny.yaml")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--contenders", default="plain,async,sync")
    parser.add_argument("--max-time", type=float, default=900.0)
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--report", metavar="ROOT", help="print the table of the runs kept in ROOT")
    parser.add_argument("--max-steps", type=int, help="stop every run after this many steps (default: none)")
    args = parse(parser, seeds="0", contenders="plain,async", max_steps=3, max_time=300)
    main()

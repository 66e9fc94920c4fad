"""End to end: time to the reward target of the default recipe, astraflow against a plain loop.

Five contenders, each run to the target (10-step moving average of the on-policy reward >= 0.8) once per
seed, in one invocation, one run at a time, in turn (so the machine's noise falls on all of them), all
from the recipe's warm-started checkpoint and rows:
- `plain`: tests/bench/plain_loop.py, a synchronous in-process GRPO loop on every core;
- `plain+ds`: the same loop with astraflow's dynamic sampling (`--dynamic-sampling`): the same algorithm
  in one process, the honest baseline for the pipeline;
- `trl`: tests/bench/trl_loop.py, TRL's `GRPOTrainer` on the recipe's settings (the `bench` extra);
- `async`: `astraflow run` (dataflow, RaaS and trainer processes on an embedded Redis);
- `sync`: `astraflow run --set trainer.mode=sync` (the same processes in lockstep, staleness 0).

Per contender: median time to target (from process start: imports, model load and process start-up
count), steps to target, wall time per step, and where a step's time goes. Plain: generation and
training. astraflow, from the trainer's side (it is the loop's clock): training (forward, backward,
optimizer), waiting for a batch, and the trainer's own work (batch fetch, weight publication, checkpoints,
metrics); generation is the RaaS's generating time per step (time with a prompt group in flight), which
overlaps the others in async mode. `cpu` is each process's CPU share of the wall time (dataflow,
Redis and launcher: the system's own work), with the Redis commands per step; `cpu/wall` is every
process's CPU over the wall time, and `gen/trained` the samples generated per sample trained. Ratios are
of median times to target; the last line, exactly:

    e2e: astraflow/TRL <r>, astraflow/plain <r>, astraflow/plain+ds <r>, sync/plain+ds <r> (<n> seeds)

(astraflow is `async`; `-` where a contender was not run or did not reach the target). Above the table,
`from weights <digest> (torch <version>, transformers <version>)`: the starting checkpoint, which steps to
target depend on; compare figures of one checkpoint only.

    python tests/bench/e2e.py [--seeds 0,1,2] [--contenders plain,plain+ds,trl,async,sync] [--max-time 900]
                              [--max-steps N]
    python tests/bench/e2e.py --report ROOT   # the table again, from the runs an invocation kept in ROOT
"""

from __future__ import annotations

import argparse
import hashlib
import json
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _smoke import parse

BENCH = Path(__file__).parent


LOOPS = {
    "plain": ["plain_loop.py"],
    "plain+ds": ["plain_loop.py", "--dynamic-sampling"],
    "trl": ["trl_loop.py"],
}
"""The in-process contenders: script and flags."""


def run(contender: str, seed: int, root: Path, cell: str = "", overrides: tuple[str, ...] = ()) -> None:
    """One run of `contender` with `seed`, its files in `root/<cell>` (default `<contender>-<seed>`; with
    `cpu.json`: the CPU seconds of all its processes). `overrides`: more `--set` of an astraflow run."""
    out = root / (cell or f"{contender}-{seed}")
    out.mkdir(parents=True, exist_ok=True)
    if contender in LOOPS:
        script, *flags = LOOPS[contender]
        cmd = [sys.executable, str(BENCH / script), *flags, "--recipe", args.recipe, "--seed", str(seed)]
        cmd += ["--max-time", str(args.max_time), "--json", str(out / "loop.json")]
        cmd += ["--max-steps", str(args.max_steps)] if args.max_steps else []
    else:
        cmd = [sys.executable, "-m", "astraflow.cli", "run", args.recipe, "--run", f"bench-{contender}"]
        for s in (f"run.dir={out}", f"run.seed={seed}", f"trainer.mode={contender}"):
            cmd += ["--set", s]
        cmd += ["--set", f"run.max_time_s={args.max_time}"]
        cmd += ["--set", f"run.max_steps={args.max_steps}"] if args.max_steps else []
        for s in overrides:
            cmd += ["--set", s]
    print(f"{contender} seed {seed}: {' '.join(cmd[1:])}", flush=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, timeout=args.max_time + 300)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    (out / "cpu.json").write_text(json.dumps({"cpu_s": cpu}))
    if done.returncode not in (0, 3):  # 3: the time limit came before the target (its figures say so)
        raise subprocess.CalledProcessError(done.returncode, cmd)


def figures(contender: str, seed: int, root: Path, cell: str = "") -> dict:
    """What one kept run measured; times in seconds, per-step figures in milliseconds. Of an astraflow
    run also: `steps_to_target` (None: not reached), `final_reward` (the last window's mean on-policy
    reward), `trained_share` (groups trained of those collected: the share of generated samples trained)
    and `stale_share` (of those collected, dropped as stale)."""
    out = root / (cell or f"{contender}-{seed}")
    cpu_s = json.loads((out / "cpu.json").read_text())["cpu_s"]
    if contender in LOOPS:
        data = json.loads((out / "loop.json").read_text())
        steps = data["steps"]
        n = len(steps)
        loop = {
            "to_target_s": data["time_to_target_s"],
            "steps": n,
            "step_ms": 1000 * (steps[-1]["wall_s"] - steps[0]["wall_s"]) / max(n - 1, 1),
            "cpu_wall": cpu_s / steps[-1]["wall_s"],
        }
        if "gen_s" in steps[0]:  # the plain loops time their phases; TRL's trainer does not say
            loop["gen_ms"] = 1000 * statistics.mean(s["gen_s"] for s in steps)
            loop["train_ms"] = 1000 * statistics.mean(s["train_s"] for s in steps)
            loop["gen_per_trained"] = sum(s["generated"] for s in steps) / sum(s["trained"] for s in steps)
        return loop
    summary = json.loads((out / "summary.json").read_text())
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    model = next(iter(summary["models"]))
    steps = [s for s in steps if s["model"] == model]
    n, window, reached, reached_step = len(steps), args.window, None, None
    rewards = [s["rollout_reward"] for s in steps]
    for i in range(window - 1, n):
        if sum(rewards[i - window + 1 : i + 1]) / window >= args.target:
            reached, reached_step = steps[i]["wall_s"], i + 1
            break
    span = steps[-1]["wall_s"] - steps[0]["wall_s"]
    step_ms = 1000 * span / max(n - 1, 1)
    train_ms = 1000 * statistics.mean(s["step_s"] for s in steps[1:])
    wait_ms = 1000 * statistics.mean(s.get("wait_s", 0.0) for s in steps[1:])
    wall = summary["wall_s"]
    ledger = summary["ledger"]["models"][model]
    stale = sum(c for reason, c in ledger["dropped"].items() if reason.startswith("stale"))
    return {
        "to_target_s": reached,
        "steps_to_target": reached_step,
        "final_reward": statistics.mean(rewards[-window:]) if rewards else None,
        "trained_share": ledger["trained"] / max(ledger["collected"], 1),
        "stale_share": stale / max(ledger["collected"], 1),
        "steps": n,
        "step_ms": step_ms,
        "gen_ms": 1000 * summary["generating_s"] / n,
        "train_ms": train_ms,
        "wait_ms": wait_ms,
        "own_ms": step_ms - train_ms - wait_ms,
        "cpu": {name: c / wall for name, c in summary.get("cpu_s", {}).items()},
        "redis_per_step": summary.get("redis_commands", 0) / n,
        "redis_per_sample": summary.get("redis_commands", 0) / max(sum(s["samples"] for s in steps), 1),
        "cpu_wall": cpu_s / wall,
        "gen_per_trained": ledger["collected"] / max(ledger["trained"], 1),
    }


def checkpoint(recipe: str) -> dict:
    """What every contender starts from: the digest of the recipe's warm-started weights (built here if
    not cached) and the versions of the packages that built them. Steps to target depend on these bytes:
    the same code and seeds on a rebuilt checkpoint took a quarter more steps for both kinds of contender
    (docs/benchmarks.md), so only figures of one checkpoint compare."""
    from importlib.metadata import version

    from astraflow.launch.tiny_cache import build_tiny
    from astraflow.settings_load import load_settings

    path = build_tiny(load_settings(recipe))
    weights = hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()[:12] if path else "-"
    return {"weights": weights, **{p: version(p) for p in ("torch", "transformers")}}


def median(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def report(results: dict[str, list[dict]], start: dict | None) -> None:
    print(f"\n{args.recipe}: to reward {args.target} (ma{args.window}), medians over seeds {args.seeds}")
    if start is not None:
        print("from weights {weights} (torch {torch}, transformers {transformers})".format(**start))
    head = ("to target", "steps", "ms/step", "gen", "train", "wait", "own", "cpu/wall", "gen/trained")
    print(f"{'':9}" + "".join(f"{h:>12}" for h in head) + "   runs (time to target)")
    medians = {}
    for c, runs in results.items():
        times = [r["to_target_s"] if r["to_target_s"] is not None else float("inf") for r in runs]
        medians[c] = statistics.median(times)
        cells = [f"{medians[c]:.0f}s" if medians[c] != float("inf") else "not reached"]
        for k in ("steps", "step_ms", "gen_ms", "train_ms", "wait_ms", "own_ms"):
            m = median(runs, k)
            cells.append("-" if m is None else f"{m:.0f}")
        for k in ("cpu_wall", "gen_per_trained"):
            m = median(runs, k)
            cells.append("-" if m is None else f"{m:.2f}")
        each = ", ".join("-" if t == float("inf") else f"{t:.0f}s" for t in times)
        print(f"{c:9}" + "".join(f"{x:>12}" for x in cells) + f"   {each}")
    for c, runs in results.items():
        if c not in LOOPS:
            names = sorted({n for r in runs for n in r["cpu"]})
            share = {n: statistics.median(r["cpu"].get(n, 0) for r in runs) for n in names}
            shares = ", ".join(f"{n} {v:.0%}" for n, v in share.items())
            per_step, per_sample = (median(runs, k) for k in ("redis_per_step", "redis_per_sample"))
            commands = f"{per_step:.0f} per step, {per_sample:.1f} per trained sample"
            print(f"{c} cpu: {shares}; Redis commands: {commands}")

    def ratio(a: str, b: str) -> str:
        if a not in medians or b not in medians or float("inf") in (medians[a], medians[b]):
            return "-"
        return f"{medians[a] / medians[b]:.2f}"

    print(
        f"e2e: astraflow/TRL {ratio('async', 'trl')}, astraflow/plain {ratio('async', 'plain')}, "
        f"astraflow/plain+ds {ratio('async', 'plain+ds')}, sync/plain+ds {ratio('sync', 'plain+ds')} "
        f"({len(args.seeds.split(','))} seeds)"
    )


def main() -> None:
    contenders, seeds = args.contenders.split(","), [int(s) for s in args.seeds.split(",")]
    root = Path(args.report or tempfile.mkdtemp(prefix="astraflow-bench-e2e-"))
    start_file = root / "checkpoint.json"
    if not args.report:
        start_file.write_text(json.dumps(checkpoint(args.recipe)))
        for seed in seeds:
            for c in contenders:
                run(c, seed, root)
    results = {c: [figures(c, s, root) for s in seeds] for c in contenders}
    (root / "results.json").write_text(json.dumps(results, indent=1))
    report(results, json.loads(start_file.read_text()) if start_file.exists() else None)
    print(f"runs kept in {root}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", default="recipes/addition-tiny.yaml")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--contenders", default="plain,plain+ds,trl,async,sync")
    parser.add_argument("--max-time", type=float, default=900.0)
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--report", metavar="ROOT", help="print the table of the runs kept in ROOT")
    parser.add_argument("--max-steps", type=int, help="stop every run after this many steps (default: none)")
    args = parse(parser, seeds="0", contenders="plain+ds,async", max_steps=3, max_time=300)
    main()

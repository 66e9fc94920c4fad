"""The tiny model's warm start with its threads picked by timing (`tiny.ThreadPick`, what
`astraflow run` does now) against one thread (what it did before, the recipes' `trainer.threads`), alone
on the machine and beside a neighbour busy on every core (`--neighbour-threads`, the machine's by
default: another run, or another test of a parallel suite).

Each arm warm-starts a fresh copy of the recipe's tiny model (`--recipe`, the calculator agent's: its
400-step warm start is the longest) for `--steps` steps and is timed whole. Arms alternate, `--rounds`
each; medians.

    python tests/bench/warm_start_threads.py [--steps 60] [--rounds 3] [--recipe RECIPE]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from _neighbour import Neighbour
from _smoke import parse

from astraflow import tiny
from astraflow.launch.tiny_cache import untrained
from astraflow.settings_load import load_settings

ARMS = {"one thread": 1, "picked": None}


def timed(base: Path, work: Path, task: str, steps: int, threads: int | None) -> float:
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(base, work)
    started = time.perf_counter()
    tiny.warm_start(work, task, steps=steps, threads=threads)
    return time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="recipes/calculator-agent.yaml")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--neighbour-threads", type=int, default=len(os.sched_getaffinity(0)))
    a = parse(p, steps=4, rounds=1)
    t = load_settings(a.recipe).run.tiny
    results: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = untrained(t, Path(tmp) / "base")
        for r in range(a.rounds):
            for where in ("alone", "beside a busy neighbour"):
                for name, threads in ARMS.items():
                    if where == "alone":
                        s = timed(base, Path(tmp) / "work", t.warm_start_task, a.steps, threads)
                    else:
                        with Neighbour(a.neighbour_threads):
                            s = timed(base, Path(tmp) / "work", t.warm_start_task, a.steps, threads)
                    results.setdefault((where, name), []).append(s)
                    print(f"round {r} {where:<24} {name:<11} {s:7.2f} s for {a.steps} steps", flush=True)
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"{'':<24} {'one thread':>11} {'picked':>8} {'picked/one':>11}")
    for where in ("alone", "beside a busy neighbour"):
        one, picked = med[(where, "one thread")], med[(where, "picked")]
        print(f"{where:<24} {one:>10.2f}s {picked:>7.2f}s {picked / one:>10.2f}x")
    ratio = {w: med[(w, "picked")] / med[(w, "one thread")] for w in ("alone", "beside a busy neighbour")}
    print(
        f"warm start threads: picked/one time alone {ratio['alone']:.2f}x, "
        f"beside a busy neighbour {ratio['beside a busy neighbour']:.2f}x"
    )


if __name__ == "__main__":
    main()

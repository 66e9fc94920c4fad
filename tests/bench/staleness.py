"""Less waste: what staleness costs and what the off-policy corrections buy back, on the default recipe.

A grid of `astraflow run` cells, each from the recipe's warm-started checkpoint until the 10-step moving
average of the on-policy reward reaches the target (or `--max-time`): `dataflow.max_staleness_steps` in
0, 1, 2, 4 x the loss
- `none`: PPO clip around the behaviour (engine) logprobs;
- `decoupled`: decoupled PPO (clip around the trainer's proximal logprobs, behaviour weight truncated);
- `tis`: `correction: tis` (ratio to the behaviour logprobs, weighted by min(prox / behav, is_cap));
- `icepop`: `correction: icepop` (tokens with prox / behav outside [0.5, 2] dropped);
- `m2po`: `m2po_threshold: 0.04` (M2PO's second-moment mask)
x seeds. Each cell is started, timed and read as e2e.py's `async` contender (its `run` and `figures`).

A cell's result is saved as `<root>/<cell>.json` when it finishes (cell `s<staleness>-<loss>-<seed>`, its
run directory beside it); a cell already saved is skipped, so the grid can be run in parts and resumed.
The table is printed from every cell saved in the root, one row per staleness and loss, medians over
the seeds saved (each seed's figure in brackets where they differ): steps to target (less noisy than
time on a shared machine), time to target, steps run, the final reward (the last window's mean),
the share of the generated samples that was trained, the share dropped as stale, and the mean
staleness of the samples trained (versions between the trainer's weights and the oldest token of a
sample's group, as the trainer counts it). Last line:

    staleness: fastest to <target>: s<k> <loss> <steps> steps, <time> s (<n> cells)

    python tests/bench/staleness.py [--staleness 0,1,2,4] [--losses none,decoupled,tis,icepop,m2po]
                                    [--seeds 0,1] [--cells s1-decoupled-0,...] [--max-time 900]
                                    [--root runs/bench-staleness]
    python tests/bench/staleness.py --report   # the table of the cells saved in the root, nothing run
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import statistics
import tempfile
from pathlib import Path

import e2e
from _smoke import parse

LOSSES = {
    "none": (),
    "decoupled": ("trainer.loss.decoupled=true",),
    "tis": ("trainer.loss.correction=tis",),
    "icepop": ("trainer.loss.correction=icepop",),
    "m2po": ("trainer.loss.m2po_threshold=0.04",),
}
"""Loss name -> the `--set` overrides of the recipe's (plain PPO-clip) loss."""


def cell_name(staleness: int, loss: str, seed: int) -> str:
    return f"s{staleness}-{loss}-{seed}"


def parse_cell(name: str) -> tuple[int, str, int]:
    """`s<staleness>-<loss>-<seed>` -> (staleness, loss, seed); ValueError for anything else."""
    head, loss, seed = name.split("-")
    if head[:1] != "s" or loss not in LOSSES:
        raise ValueError(f"not a cell: {name!r} (s<staleness>-<loss>-<seed>, loss one of {list(LOSSES)})")
    return int(head[1:]), loss, int(seed)


def cells() -> list[tuple[int, str, int]]:
    """The cells asked for: `--cells`, else the product of `--staleness`, `--losses` and `--seeds`."""
    if args.cells:
        return [parse_cell(c) for c in args.cells.split(",")]
    staleness = [int(s) for s in args.staleness.split(",")]
    losses = args.losses.split(",")
    for loss in losses:
        if loss not in LOSSES:
            raise SystemExit(f"unknown loss {loss!r}: one of {', '.join(LOSSES)}")
    return list(itertools.product(staleness, losses, [int(s) for s in args.seeds.split(",")]))


def run_cell(root: Path, staleness: int, loss: str, seed: int) -> None:
    """Run one cell unless it is saved; save its figures as `<root>/<cell>.json`."""
    name = cell_name(staleness, loss, seed)
    saved = root / f"{name}.json"
    if saved.exists():
        print(f"{name}: saved, skipped", flush=True)
        return
    shutil.rmtree(root / name, ignore_errors=True)  # an interrupted cell: its run would resume, not restart
    e2e.run("async", seed, root, name, (f"dataflow.max_staleness_steps={staleness}", *LOSSES[loss]))
    figures = e2e.figures("async", seed, root, name)
    steps = [json.loads(x) for x in (root / name / "metrics.jsonl").read_text().splitlines()]
    trained = [s for s in steps if "staleness_mean" in s]  # as the trainer saw it: from the version it held
    lag = {"lag_mean": statistics.mean(s["staleness_mean"] for s in trained) if trained else None}
    cell = {"staleness": staleness, "loss": loss, "seed": seed, "max_time_s": args.max_time, **figures, **lag}
    saved.write_text(json.dumps(cell, indent=1))
    reached = "not reached" if figures["to_target_s"] is None else f"{figures['to_target_s']:.0f} s"
    print(f"{name}: {reached}, {figures['steps']} steps, final {figures['final_reward']:.2f}", flush=True)


def saved_cells(root: Path) -> list[dict]:
    out = []
    for path in sorted(root.glob("s*-*-*.json")):
        try:
            parse_cell(path.stem)
        except ValueError:
            continue
        out.append(json.loads(path.read_text()))
    return out


def column(runs: list[dict], key: str, fmt: str) -> str:
    """The median over `runs` (a run that did not reach the target counts as infinite), and each run's
    value in brackets when there are several."""
    values = [r[key] if r[key] is not None else float("inf") for r in runs]
    show = lambda v: "-" if v == float("inf") else format(v, fmt)  # noqa: E731
    each = f" ({', '.join(show(v) for v in values)})" if len(values) > 1 else ""
    return show(statistics.median(values)) + each


def report(saved: list[dict]) -> None:
    print(f"\n{args.recipe}: to reward {args.target} (ma{args.window}), medians over the seeds saved\n")
    head = ["staleness", "loss", "seeds", "steps to target", "time to target (s)", "steps", "final reward"]
    head += ["trained / generated", "dropped stale", "staleness trained"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    rows = {}
    for c in saved:
        rows.setdefault((c["staleness"], list(LOSSES).index(c["loss"])), []).append(c)
    best = None
    for (staleness, i), runs in sorted(rows.items()):
        runs.sort(key=lambda r: r["seed"])
        cells = [str(staleness), list(LOSSES)[i], ",".join(str(r["seed"]) for r in runs)]
        cells += [column(runs, "steps_to_target", ".0f"), column(runs, "to_target_s", ".0f")]
        cells += [column(runs, "steps", ".0f"), column(runs, "final_reward", ".2f")]
        cells += [column(runs, "trained_share", ".0%"), column(runs, "stale_share", ".0%")]
        cells += [column([{"lag": r.get("lag_mean")} for r in runs], "lag", ".2f")]
        print("| " + " | ".join(cells) + " |")
        steps = statistics.median(r["steps_to_target"] or float("inf") for r in runs)
        time = statistics.median(r["to_target_s"] or float("inf") for r in runs)
        if steps != float("inf") and (best is None or steps < best[0]):
            best = (steps, time, f"s{staleness} {list(LOSSES)[i]}")
    fastest = "-" if best is None else f"{best[2]} {best[0]:.0f} steps, {best[1]:.0f} s"
    print(f"\nstaleness: fastest to {args.target}: {fastest} ({len(saved)} cells)")


def main() -> None:
    root = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="astraflow-bench-staleness-"))
    root.mkdir(parents=True, exist_ok=True)
    if not args.report:
        for staleness, loss, seed in cells():
            run_cell(root, staleness, loss, seed)
    report(saved_cells(root))
    print(f"cells kept in {root}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", default="recipes/addition-tiny.yaml")
    parser.add_argument("--staleness", default="0,1,2,4", help="max_staleness_steps values")
    parser.add_argument("--losses", default=",".join(LOSSES), help=f"of {', '.join(LOSSES)}")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--cells", default="", help="cells s<staleness>-<loss>-<seed>, instead of the grid")
    parser.add_argument("--max-time", type=float, default=900.0, help="per cell, seconds")
    parser.add_argument("--max-steps", type=int, help="stop every cell after this many steps (default: none)")
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--root", default="runs/bench-staleness", help="cells saved here ('': a temp dir)")
    parser.add_argument("--report", action="store_true", help="print the table of the saved cells only")
    args = parse(parser, staleness="1", losses="decoupled", seeds="0", max_steps=3, max_time=300, root="")
    e2e.args = args  # e2e's run and figures read the recipe, limits, target and window from it
    main()

"""Less waste: what staleness costs and what the off-policy corrections buy back, on the default recipe.

A grid of `astraflow run` cells, each from the recipe's warm-started checkpoint until the 10-step moving
average of the on-policy reward reaches the target (or `--max-time`): `dataflow.max_staleness_steps` x the
loss (`trainer.loss.correction`, each as its paper defines it: `astraflow.trainer.losses`)
- `none`: PPO clip around the behaviour (engine) logprobs;
- `decoupled`: decoupled PPO (clip around the trainer's proximal logprobs, behaviour weight w), with the
  cap mode an axis of its own: `decoupled` (no cap, AReaL's default), `decoupled.clamp` (min(w, cap)),
  `decoupled.drop` (weight 0 above the cap), the cap `--decoupled-cap`;
- `tis`: truncated importance sampling, the trainer's ratio weighted once by min(w, 2);
- `icepop`: the trainer's ratio weighted by w, tokens with w outside [0.5, 5] masked;
- `m2po`: the unclipped ratio to the behaviour logprobs, M2PO's second-moment mask (0.04)
x `trainer.minibatches` (optimizer steps per batch: with one, the proximal ratio is 1 at the step and
decoupled PPO's clip never acts) x seeds. `--grid corrections` is issue 44's grid instead: staleness 0, 2,
8 x {none, decoupled.clamp, decoupled.drop, tis, icepop} at 4 minibatches, plus none and decoupled.clamp
at 1 minibatch (42 cells with two seeds). Each cell is started, timed and read as e2e.py's `async`
contender (its `run` and `figures`).

A cell's result is saved as `<root>/<cell>.json` when it finishes (cell `s<staleness>-<loss>-m<minibatches>-
<seed>`, its run directory beside it); a cell already saved is skipped, so the grid can be run in parts and
resumed. The table is printed from every cell saved in the root, one row per staleness, loss and
minibatches, medians over the seeds saved (each seed's figure in brackets where they differ): steps to
target (less noisy than time on a shared machine), time to target, steps run, the final reward (the last
window's mean), the share of the generated samples that was trained, the share dropped as stale, and the
mean staleness of the samples trained (versions between the trainer's weights and the oldest token of a
sample's group, as the trainer counts it). Last line:

    staleness: fastest to <target>: s<k> <loss> m<minibatches> <steps> steps, <time> s (<n> cells)

    python tests/bench/staleness.py --grid corrections [--seeds 0,1] [--max-time 900]
    python tests/bench/staleness.py [--staleness 0,2,8] [--losses none,decoupled,tis,icepop,m2po]
                                    [--cap-modes clamp,drop] [--minibatches 1,4] [--seeds 0,1]
                                    [--cells s2-decoupled.drop-m4-0,...] [--root runs/bench-staleness]
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

CORRECTION = "trainer.loss.correction"
LOSSES = {
    "none": (),
    "decoupled": (f"{CORRECTION}=decoupled",),
    "decoupled.clamp": (f"{CORRECTION}=decoupled", "trainer.loss.decoupled_cap_mode=clamp"),
    "decoupled.drop": (f"{CORRECTION}=decoupled", "trainer.loss.decoupled_cap_mode=drop"),
    "tis": (f"{CORRECTION}=tis",),
    "icepop": (f"{CORRECTION}=icepop",),
    "m2po": (f"{CORRECTION}=m2po",),
}
"""Loss name -> the `--set` overrides of the recipe's (plain PPO-clip) loss; a capped decoupled loss also
gets `decoupled_cap` (`overrides`)."""
GRIDS = {
    "corrections": [
        *(
            (s, loss, 4)
            for s in (0, 2, 8)
            for loss in ("none", "decoupled.clamp", "decoupled.drop", "tis", "icepop")
        ),
        *((s, loss, 1) for s in (0, 2, 8) for loss in ("none", "decoupled.clamp")),
    ],
}
"""Named grids: (staleness, loss, minibatches) cells, each run with every seed of `--seeds`."""


def overrides(staleness: int, loss: str, minibatches: int) -> tuple[str, ...]:
    """The `--set` overrides of one cell."""
    out = (f"dataflow.max_staleness_steps={staleness}", f"trainer.minibatches={minibatches}", *LOSSES[loss])
    return out + ((f"trainer.loss.decoupled_cap={args.decoupled_cap}",) if "." in loss else ())


def cell_name(staleness: int, loss: str, minibatches: int, seed: int) -> str:
    return f"s{staleness}-{loss}-m{minibatches}-{seed}"


def parse_cell(name: str) -> tuple[int, str, int, int]:
    """`s<staleness>-<loss>-m<minibatches>-<seed>` -> its parts; ValueError for anything else (cells saved
    before minibatches were an axis, and before the corrected losses, among them)."""
    parts = name.split("-")
    if len(parts) != 4 or parts[0][:1] != "s" or parts[1] not in LOSSES or parts[2][:1] != "m":
        raise ValueError(
            f"not a cell: {name!r} (s<staleness>-<loss>-m<minibatches>-<seed>, loss one of {list(LOSSES)})"
        )
    return int(parts[0][1:]), parts[1], int(parts[2][1:]), int(parts[3])


def cells() -> list[tuple[int, str, int, int]]:
    """The cells asked for: `--cells`, else `--grid`'s with `--seeds`, else the product of `--staleness`,
    `--losses` (decoupled once per `--cap-modes`), `--minibatches` and `--seeds`."""
    if args.cells:
        return [parse_cell(c) for c in args.cells.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.grid:
        return [(s, loss, m, seed) for s, loss, m in GRIDS[args.grid] for seed in seeds]
    losses = []
    for loss in args.losses.split(","):
        if loss != "decoupled":
            losses.append(loss)
            continue
        modes = [m for m in args.cap_modes.split(",") if m]
        losses += [f"decoupled.{m}" if m != "none" else "decoupled" for m in modes] or ["decoupled"]
    for loss in losses:
        if loss not in LOSSES:
            raise SystemExit(f"unknown loss {loss!r}: one of {', '.join(LOSSES)}")
    staleness = [int(s) for s in args.staleness.split(",")]
    minibatches = [int(m) for m in args.minibatches.split(",")]
    return list(itertools.product(staleness, losses, minibatches, seeds))


def run_cell(root: Path, staleness: int, loss: str, minibatches: int, seed: int) -> None:
    """Run one cell unless it is saved; save its figures as `<root>/<cell>.json`."""
    name = cell_name(staleness, loss, minibatches, seed)
    saved = root / f"{name}.json"
    if saved.exists():
        print(f"{name}: saved, skipped", flush=True)
        return
    shutil.rmtree(root / name, ignore_errors=True)  # an interrupted cell: its run would resume, not restart
    sets = overrides(staleness, loss, minibatches)
    e2e.run("async", seed, root, name, sets)
    figures = e2e.figures("async", seed, root, name)
    steps = [json.loads(x) for x in (root / name / "metrics.jsonl").read_text().splitlines()]
    trained = [s for s in steps if "staleness_mean" in s]  # as the trainer saw it: from the version it held
    lag = {"lag_mean": statistics.mean(s["staleness_mean"] for s in trained) if trained else None}
    cell = {"staleness": staleness, "loss": loss, "minibatches": minibatches, "seed": seed}
    cell.update(max_time_s=args.max_time, overrides=list(sets), **figures, **lag)
    saved.write_text(json.dumps(cell, indent=1))
    reached = "not reached" if figures["to_target_s"] is None else f"{figures['to_target_s']:.0f} s"
    print(f"{name}: {reached}, {figures['steps']} steps, final {figures['final_reward']:.2f}", flush=True)


def saved_cells(root: Path) -> list[dict]:
    out = []
    for path in sorted(root.glob("s*-*-m*-*.json")):
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
    cap = f"decoupled cap {args.decoupled_cap}"
    print(
        f"\n{args.recipe}: to reward {args.target} (ma{args.window}), {cap}, medians over the seeds saved\n"
    )
    head = ["staleness", "loss", "minibatches", "seeds", "steps to target", "time to target (s)", "steps"]
    head += ["final reward"]
    head += ["trained / generated", "dropped stale", "staleness trained"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    rows = {}
    for c in saved:
        rows.setdefault((c["staleness"], list(LOSSES).index(c["loss"]), c["minibatches"]), []).append(c)
    best = None
    for (staleness, i, minibatches), runs in sorted(rows.items()):
        runs.sort(key=lambda r: r["seed"])
        cells = [str(staleness), list(LOSSES)[i], str(minibatches), ",".join(str(r["seed"]) for r in runs)]
        cells += [column(runs, "steps_to_target", ".0f"), column(runs, "to_target_s", ".0f")]
        cells += [column(runs, "steps", ".0f"), column(runs, "final_reward", ".2f")]
        cells += [column(runs, "trained_share", ".0%"), column(runs, "stale_share", ".0%")]
        cells += [column([{"lag": r.get("lag_mean")} for r in runs], "lag", ".2f")]
        print("| " + " | ".join(cells) + " |")
        steps = statistics.median(r["steps_to_target"] or float("inf") for r in runs)
        time = statistics.median(r["to_target_s"] or float("inf") for r in runs)
        if steps != float("inf") and (best is None or steps < best[0]):
            best = (steps, time, f"s{staleness} {list(LOSSES)[i]} m{minibatches}")
    fastest = "-" if best is None else f"{best[2]} {best[0]:.0f} steps, {best[1]:.0f} s"
    print(f"\nstaleness: fastest to {args.target}: {fastest} ({len(saved)} cells)")


def main() -> None:
    root = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="astraflow-bench-staleness-"))
    root.mkdir(parents=True, exist_ok=True)
    if not args.report:
        for cell in cells():
            run_cell(root, *cell)
    report(saved_cells(root))
    print(f"cells kept in {root}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", default="recipes/addition-tiny.yaml")
    parser.add_argument("--staleness", default="0,2,8", help="max_staleness_steps values")
    parser.add_argument("--losses", default="none,decoupled,tis,icepop,m2po", help=f"of {', '.join(LOSSES)}")
    parser.add_argument("--cap-modes", default="clamp,drop", help="decoupled's: of none, clamp, drop")
    parser.add_argument("--decoupled-cap", type=float, default=2.0, help="the cap of decoupled.clamp/.drop")
    parser.add_argument("--minibatches", default="4", help="trainer.minibatches values")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--grid", choices=sorted(GRIDS), help="a named grid instead of the axes")
    parser.add_argument("--cells", default="", help="cells s<staleness>-<loss>-m<minibatches>-<seed>")
    parser.add_argument("--max-time", type=float, default=900.0, help="per cell, seconds")
    parser.add_argument("--max-steps", type=int, help="stop every cell after this many steps (default: none)")
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--root", default="runs/bench-staleness", help="cells saved here ('': a temp dir)")
    parser.add_argument("--report", action="store_true", help="print the table of the saved cells only")
    smoke = {"staleness": "1", "losses": "decoupled", "cap_modes": "drop", "minibatches": "2", "seeds": "0"}
    args = parse(parser, **smoke, max_steps=3, max_time=300, root="")
    e2e.args = args  # e2e's run and figures read the recipe, limits, target and window from it
    main()

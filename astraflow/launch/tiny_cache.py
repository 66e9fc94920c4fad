"""The recipe's tiny model (`run.tiny`), built and warm-started once per configuration."""

from __future__ import annotations

import contextlib
import fcntl
import shutil
import time
from pathlib import Path

from astraflow import tiny
from astraflow.config import Settings, TinyModelSettings


def build_tiny(settings: Settings) -> Path | None:
    """Build `run.tiny`'s model at its cache path unless it is there already; None without `run.tiny`.
    Every policy that names no starting weights starts from it (`Settings.policy`). Processes that
    start at once build it once: the others wait for that build."""
    t = settings.run.tiny
    if t is None:
        return None
    path = t.path
    if (path / "ready").exists():
        return path
    with _building(path):  # a trainer and a RaaS started together: one builds, the other waits for it
        if not (path / "ready").exists():
            _build(settings, path)
    return path


@contextlib.contextmanager
def _building(path: Path):
    """Hold the build lock of `path` (`flock` on a file beside it: released by the kernel when the
    holder dies, so a crashed build never blocks the next one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f"{path.name}.lock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"another process builds the tiny model in {path}: waiting for it", flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build(settings: Settings, path: Path) -> None:
    """Build and warm-start the model at `path` (under the build lock), marking it `ready` last."""
    t = settings.run.tiny
    shutil.rmtree(path, ignore_errors=True)  # a build that died half-way
    print(f"building the tiny model in {path} (once)", flush=True)
    untrained(t, path)
    if t.warm_start_task and t.warm_start_steps:
        # Its threads chosen by timing (`tiny.ThreadPick`): all the machine's while nothing else runs, as
        # before a run's workers start; one beside a busy neighbour, where more are seven times slower.
        steps, task = t.warm_start_steps, t.warm_start_task
        loss = tiny.warm_start(path, task, steps=steps, seed=t.seed, on_step=warm_start_progress(steps))
        print(f"warm start: {steps} supervised steps on {task}, loss {loss:.3f}", flush=True)
    (path / "ready").touch()


def untrained(t: TinyModelSettings, path: Path) -> Path:
    """`t`'s model at `path` as built, before any warm start (its random weights are `t.seed`'s)."""
    return tiny.build(
        path,
        tokenizer_kind=t.tokenizer,
        hidden=t.hidden,
        layers=t.layers,
        heads=t.heads,
        kv_heads=t.kv_heads,
        intermediate=t.intermediate,
        seed=t.seed,
    )


def warm_start_progress(steps: int, every_s: float = 5.0):
    """An `on_step` that prints `warm start: 120/300 steps (40%), loss 0.812` at most every `every_s`
    (the warm start takes a minute or more on a small machine, and prints nothing else meanwhile)."""
    last = time.monotonic()

    def on_step(done: int, loss: float) -> None:
        nonlocal last
        if done < steps and time.monotonic() - last >= every_s:
            print(f"warm start: {done}/{steps} steps ({done / steps:.0%}), loss {loss:.3f}", flush=True)
            last = time.monotonic()

    return on_step

"""The recipe's tiny model (`run.tiny`), built and warm-started once per configuration."""

from __future__ import annotations

import shutil
from pathlib import Path

from astraflow.config import Settings


def build_tiny(settings: Settings) -> Path | None:
    """Build `run.tiny`'s model at its cache path unless it is there already; None without `run.tiny`.
    Every policy that names no starting weights starts from it (`Settings.policy`)."""
    from astraflow import tiny

    t = settings.run.tiny
    if t is None:
        return None
    path = t.path
    if (path / "ready").exists():
        return path
    shutil.rmtree(path, ignore_errors=True)
    print(f"building the tiny model in {path} (once)", flush=True)
    tiny.build(
        path,
        tokenizer_kind=t.tokenizer,
        hidden=t.hidden,
        layers=t.layers,
        heads=t.heads,
        kv_heads=t.kv_heads,
        intermediate=t.intermediate,
        seed=t.seed,
    )
    if t.warm_start_task and t.warm_start_steps:
        # The trainer's thread count when the recipe sets one: on a shared machine two threads of a model
        # this small were ten times slower than one (a 10-step warm start, 21 s against 1.5 s).
        threads = settings.trainer.threads or None
        steps, task = t.warm_start_steps, t.warm_start_task
        loss = tiny.warm_start(path, task, steps=steps, seed=t.seed, threads=threads)
        print(
            f"warm start: {t.warm_start_steps} supervised steps on {t.warm_start_task}, loss {loss:.3f}",
            flush=True,
        )
    (path / "ready").touch()
    return path

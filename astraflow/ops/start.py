"""The commands that start processes of a run: `astraflow run` (the whole run on one machine, or the bus
demo) and `astraflow raas|trainer|dataflow` (one worker, joining the run on a shared Redis)."""

from __future__ import annotations

from pathlib import Path

from astraflow.launch import demo, launcher
from astraflow.launch.services import run_dataflow, run_raas, run_trainer
from astraflow.launch.start_checks import worker_start
from astraflow.launch.tiny_cache import build_tiny
from astraflow.ops.context import redis_url, settings_from


def cmd_raas(args) -> int:
    settings = settings_from(args)
    url = redis_url(settings)
    with worker_start(url, settings, args.resume):
        build_tiny(settings)
        run_raas(settings, url)
    return 0


def cmd_trainer(args) -> int:
    settings = settings_from(args)
    url = redis_url(settings)
    with worker_start(url, settings, args.resume):
        build_tiny(settings)
        run_trainer(settings, url, args.model)
    return 0


def cmd_dataflow(args) -> int:
    settings = settings_from(args)
    url = redis_url(settings)
    with worker_start(url, settings, args.resume):
        run_dataflow(settings, url)
    return 0


def cmd_run(args) -> int:
    if args.resume:  # the run's own settings, as it saved them (overrides still apply)
        args.recipe = str(Path(args.resume) / "settings.yaml")
        args.set = [*args.set, f"run.dir={args.resume}"]
    if args.recipe is None:
        args.recipe = args.default_recipe  # the parser's (`cli.DEFAULT_RECIPE`)
    settings = settings_from(args)
    if settings.run.kind == "demo":
        return demo.main(settings, keep_redis=args.keep_redis)
    return launcher.main(
        settings, keep_redis=args.keep_redis, resume=bool(args.resume), overwrite=args.overwrite
    )

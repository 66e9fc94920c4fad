"""`astraflow run RECIPE`: the whole loop on one machine, supervised, until the recipe's target.

Starts an embedded Redis (unless `--redis`), builds the recipe's tiny model once (cached), starts the
dataflow, the RaaS workers and one trainer per model as separate processes (restarted when they die),
shows progress, and leaves logs, `metrics.jsonl`, checkpoints, `summary.json` and `reward.png` in the run
directory. Ctrl-C, SIGTERM and SIGHUP stop everything cleanly and still write the report; `--resume`
continues a stopped run from its directory. The run directory must be empty unless resuming or told to
`--overwrite` it, and is locked for the launcher's life (`run_dir`).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

from astraflow import layout, logs, redis_server
from astraflow.config import Settings, redact_url
from astraflow.errors import RunDirError, WorkerFailed
from astraflow.launch import report
from astraflow.launch.local_run import LocalRun
from astraflow.launch.progress import Progress, line, render
from astraflow.launch.run_dir import claim
from astraflow.launch.start_checks import check_start
from astraflow.launch.stops import EXIT_TARGET_MISSED, AllDead, stop_reason, stopped_elsewhere
from astraflow.launch.supervisor import Supervisor, Worker, cpu_seconds
from astraflow.launch.tiny_cache import build_tiny
from astraflow.processes import STOP_SIGNALS, Stopped, exit_status
from astraflow.settings_load import to_env
from astraflow.streams import Bus
from astraflow.streams.identity import mark_stopped
from astraflow.tracking.tracker import follow
from astraflow.workflows import sandbox
from astraflow.workflows.api import runs_tools


def place_threads(settings: Settings) -> None:
    """torch threads left at 0 (the recipe's choice: automatic) share this machine's cores: in async mode
    a trainer and a RaaS run at once, so each gets half of them (more would only contend); in sync mode
    they take turns, and each gets all of them."""
    cores = os.cpu_count() or 1
    share = cores if settings.trainer.mode == "sync" else max(1, cores // 2)
    settings.trainer.threads = settings.trainer.threads or share
    settings.engine.threads = settings.engine.threads or share


def workers(settings: Settings) -> list[Worker]:
    run_dir = settings.run.path
    supervised = settings.model_copy(deep=True)
    supervised.run.supervised = True  # the launcher judges the stop conditions and stops them
    settings = supervised
    base = to_env(settings)

    def env(**overrides) -> dict[str, str]:
        s = settings.model_copy(deep=True)
        for dotted, value in overrides.items():
            section, key = dotted.split("__")
            setattr(getattr(s, section), key, value)
        return {**base, **to_env(s)}

    plan = layout.plan(settings.layout) if settings.layout.gpus else None
    out = [
        Worker(
            "dataflow", "workers.dataflow", env(dataflow__id="dataflow-0"), run_dir / "logs" / "dataflow.log"
        )
    ]
    for i in range(settings.run.raas_workers):
        gpus = {} if plan is None else {"engine__devices": ",".join(plan.engines[i])}
        raas = env(raas__id=f"raas-{i}", **gpus)
        if plan is not None:  # the engine's GPUs only (a vllm server inherits them)
            raas["CUDA_VISIBLE_DEVICES"] = gpus["engine__devices"]
        out.append(Worker(f"raas-{i}", "workers.raas", raas, run_dir / "logs" / f"raas-{i}.log"))
    for m in settings.trained:
        w = Worker(
            f"trainer-{m}",
            "workers.trainer",
            {**base, "ASTRAFLOW_POLICY": m},
            run_dir / "logs" / f"trainer-{m}.log",
        )
        if plan is not None:  # one rank per GPU, under torchrun when more than one
            ids = ",".join(plan.trainer)
            w.env = {**env(trainer__devices=ids), "ASTRAFLOW_POLICY": m, "CUDA_VISIBLE_DEVICES": ids}
            if len(plan.trainer) > 1:
                w.module = "torch.distributed.run"
                w.args = ["--standalone", "--nproc_per_node", str(len(plan.trainer)), "-m", "workers.trainer"]
        out.append(w)
    return out


def _save_settings(settings: Settings, path: Path) -> None:
    """The run's settings for `--resume` (owner-readable only: they may hold secrets); the embedded
    Redis's URL is left out, a resumed run starts it again from its data."""
    import os

    import yaml
    from pydantic import SecretStr

    def plain(value):  # every secret as itself (a masked one would come back as its mask), the rest as text
        return value.get_secret_value() if isinstance(value, SecretStr) else str(value)

    data = json.loads(json.dumps(settings.model_dump(), default=plain))
    if settings.redis.url is None:
        data["redis"].pop("url", None)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(data, f, sort_keys=False)


SETTINGS = "settings.yaml"
"""The run's settings in its directory: what `--resume DIR` loads."""

EXIT_FAILED = 1
"""A worker died more often than its restart budget allows (its last error line is printed)."""


def main(settings: Settings, keep_redis: bool = False, resume: bool = False, overwrite: bool = False) -> int:
    """Runs until a stop condition or a stop signal, and writes the report either way. The exit status:
    0 at the reward target, or at a step or time limit when no target is set; EXIT_TARGET_MISSED at a
    limit before the target; EXIT_FAILED when a worker keeps dying; the signal's for Ctrl-C, SIGTERM or
    SIGHUP (`processes.exit_status`: 130, 143, 129). A run directory that holds anything is refused
    unless `resume` or `overwrite` (RunDirError), as is one a live launcher holds; a machine whose tools
    cannot be sandboxed, unless the recipe allows it (SandboxUnavailable)."""
    local = LocalRun(settings, keep_redis)  # the stop signals raise Stopped until the watch takes them
    logs.configure("warning", run=settings.run.name, worker="launcher")  # the terminal is the progress view
    run_dir = settings.run.path
    held = None
    try:
        held = claim(run_dir, resume=resume, overwrite=overwrite)  # refused before anything is touched
        tools = runs_tools(settings.dataflow.feeder.workflow, settings.raas.workflow_options)
        sandbox.require(settings.raas.sandbox, tools)  # as each RaaS would refuse, once, before all else
        if settings.redis.url:  # a shared Redis: may this run start there? (before changing its directory)
            asyncio.run(check_start(settings.redis.url, settings, fresh=not resume, resume=resume))
        if overwrite:  # `--resume` keeps Redis (AOF), checkpoints and metrics
            _kept_redis_stopped(run_dir)
            held.clear()
        held.mark(settings.run.name)  # first: what --overwrite asks of a directory before emptying it
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        _save_settings(settings, run_dir / SETTINGS)
        build_tiny(settings)
        place_threads(settings)
        if not settings.redis.url:
            asyncio.run(check_start(local.start_redis(), settings, fresh=not resume, resume=resume))
        print(f"run {settings.run.name!r} in {run_dir} on {redact_url(settings.redis.url)}", flush=True)
        for text in _layout_lines(settings):
            print(text, flush=True)
        for w in workers(settings):
            local.supervisor.start(w)
        return asyncio.run(_watch(settings, local.supervisor, resume, local.redis_pid))
    except (KeyboardInterrupt, Stopped) as e:  # before the watch began: nothing to report yet
        signum = e.signum if isinstance(e, Stopped) else signal.SIGINT
        print(f"stopping ({STOP_SIGNALS[signum]})", flush=True)
        return exit_status(signum)
    finally:
        local.close()
        if held is not None:
            held.release()


def _kept_redis_stopped(run_dir: Path) -> None:
    """Refuse to overwrite the data of a Redis an earlier run left running there (`--keep-redis`)."""
    server = redis_server.load(run_dir / "redis")
    if server is not None and server.alive():
        raise RunDirError(
            f"{run_dir}: the Redis an earlier run kept (pid {server.pid}) still runs on its data: stop it"
            " first (`astraflow redis stop --set run.dir=...`)"
        )


async def _watch(settings: Settings, supervisor: Supervisor, resume: bool, redis_pid: int | None) -> int:
    r = settings.run
    received: list[int] = []  # stop like at a target, with the report
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, received.append, sig)
    bus = Bus.connect(settings.redis.url or "", r.name, settings.redis, settings.streams)
    await bus.bootstrap(settings.trained)
    tracking = await follow(settings, bus)  # TensorBoard, W&B, MLflow (`tracking.sinks`), if any
    live = _live() if sys.stdout.isatty() else None
    # Stop conditions need the metrics every second; the view's details less often (they cost a core's
    # share on a small machine): as often as the view shows them.
    detail_every_s = 2.0 if live is not None else 5.0
    progress = Progress(bus, settings.trained, r.reward_window, r.path / "metrics.jsonl", detail_every_s)
    if resume:  # metrics.jsonl already holds what came before
        last = await bus.redis.xrevrange(bus.keys.metrics, count=1)
        progress.skip_to(last[0][0].decode() if last else "0-0")
    reason, status, failed, last_line = None, 0, None, 0.0
    all_dead = AllDead(r.stop_after_dead_groups)
    try:
        while reason is None:
            await asyncio.sleep(1.0)
            if received:
                reason, status = f"interrupted ({STOP_SIGNALS[received[0]]})", exit_status(received[0])
                break
            try:
                restarted = supervisor.check()
            except WorkerFailed as e:  # a worker that keeps dying: stop the run, keep what it made
                print(f"stopping: {e}", flush=True)
                reason, status, failed = str(e), EXIT_FAILED, e
                break
            for name in restarted:
                print(f"restarted {name}", flush=True)
            snap = await _unless_failing("progress", progress.poll)  # (a view that failed this second
            if snap is not None:  # must not end the run, nor keep it past its time limit)
                if live is not None:
                    live.update(_with_layout(render(snap, r.reward_window, r.target_reward), settings))
                elif time.monotonic() - last_line >= 5:
                    print(line(snap, r.reward_window), flush=True)
                    last_line = time.monotonic()
            reason, status = stop_reason(r, progress) or (None, 0)
            if reason is None and snap is not None:
                verdict = await _unless_failing(
                    "stop notice", lambda s=snap: _elsewhere(bus, r, progress, all_dead, s)
                )
                reason, status = verdict or (None, 0)
    finally:
        if live is not None:
            live.stop()
    wall_s = time.time() - progress.started
    # The report is written whatever Redis does now: each fact it cannot read is left out.
    info = await _unless_failing("redis stats", lambda: bus.redis.info("stats"))
    commands = info["total_commands_processed"] if info else None  # the embedded Redis: this run's
    cpu = {**supervisor.cpu_s(), "launcher": sum(os.times()[:2])}
    if redis_pid is not None:
        cpu["redis"] = cpu_seconds(redis_pid)
    supervisor.stop()
    await _unless_failing("tracking", tracking.stop)  # after the workers: what they wrote last reaches
    progress.detail_every_s = 0.0  # the report's ledger and generating time as they are now
    last = await _unless_failing("ledger", progress.poll)
    extra = {
        "stopped": reason,
        "exit_status": status,
        **({"failed": {"worker": failed.worker, "error": failed.error}} if failed else {}),
        "wall_s": round(wall_s, 1),
        "cpu_s": {name: round(c, 1) for name, c in cpu.items()},
        **({"redis_commands": commands} if commands is not None else {}),
        "restarts": {n: w.restarts for n, w in supervisor.workers.items()},
        **({"ledger": last.ledger.as_dict()} if last is not None and last.ledger is not None else {}),
    }
    data = report.write(r.path, progress, r.reward_window, extra)
    # A worker started later does not join it unless resuming.
    await _unless_failing("stop notice", lambda: mark_stopped(bus, reason, by="launcher"))
    await _unless_failing("redis", bus.close)
    print(json.dumps(data["models"], indent=2), flush=True)
    print(f"stopped: {reason}; see {r.path / 'reward.png'} and {r.path / 'summary.json'}", flush=True)
    print(report.busy_line(data), flush=True)
    if failed is not None:  # the cause, last (and on stderr, where a script looks)
        print(f"astraflow: run failed: {failed}", file=sys.stderr, flush=True)
    elif status == EXIT_TARGET_MISSED:
        print(
            f"astraflow: reward target {r.target_reward} not reached ({reason})", file=sys.stderr, flush=True
        )
    return status


async def _elsewhere(bus: Bus, r, progress: Progress, all_dead: AllDead, snap) -> tuple[str, int] | None:
    """The verdicts that read Redis beyond the metrics: a stop notice someone else wrote, every group
    dead-lettered."""
    return await stopped_elsewhere(bus, r, progress) or await all_dead.check(bus, snap.ledger)


async def _unless_failing(what: str, call):
    """`await call()`, or None (said on a line) when it raises: Redis refusing or away must neither end
    the run nor keep it past its time limit, and the report is written all the same."""
    try:
        return await call()
    except Exception as e:
        print(f"{what} unavailable: {e!r}", flush=True)
        return None


def _layout_lines(settings: Settings) -> list[str]:
    """Each trainer rank's and RaaS engine's GPUs, a line per process (none without a layout)."""
    return layout.plan(settings.layout).lines() if settings.layout.gpus else []


def _with_layout(view, settings: Settings):
    """The live view with the node's layout under it."""
    from rich.console import Group

    lines = _layout_lines(settings)
    return Group(view, "layout: " + "; ".join(lines)) if lines else view


def _live():
    from rich.live import Live

    live = Live(refresh_per_second=2)
    live.start()
    return live

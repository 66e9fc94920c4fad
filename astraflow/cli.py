"""The `astraflow` command. Imports stay inside the handlers so `astraflow --help` is instant."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

DEFAULT_RECIPE = "recipes/addition-tiny.yaml"


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "handler"):
        parser.print_help()
        return 2
    from astraflow.errors import AstraflowError

    try:
        return args.handler(args) or 0
    except AstraflowError as e:
        print(f"astraflow: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="astraflow", description="RL of LLMs as a dataflow on Redis Streams.")
    sub = p.add_subparsers(metavar="COMMAND")

    def command(name: str, handler, help: str, recipe: bool = True) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=help, description=help)
        if recipe:
            c.add_argument("recipe", nargs="?", help="recipe YAML")
        c.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="SECTION.KEY=VALUE",
            help="override a setting (repeatable)",
        )
        c.add_argument("--run", help="run name (run.name)")
        c.add_argument("--redis", help="redis://host:port/db of a shared Redis (default: the embedded one)")
        c.add_argument("--redis-file", metavar="PATH", help="read the --redis URL from PATH")
        c.set_defaults(handler=handler)
        return c

    run = command("run", _cmd_run, f"run a recipe end to end on one machine (default {DEFAULT_RECIPE})")
    run.add_argument("--keep-redis", action="store_true", help="leave the embedded Redis running afterwards")
    run.add_argument("--resume", metavar="RUN_DIR", help="continue a stopped run from its directory")
    command("top", _cmd_top, "live progress of a run (also one started elsewhere: --redis URL --run NAME)")
    command("inspect", _cmd_inspect, "every stream: length, groups, consumers, pending, lag; dead letters")
    command("config", _cmd_config, "print the effective settings (secrets masked)")
    redis = command(
        "redis", _cmd_redis, "the embedded redis-server (start/stop/status); a run's ACL users", False
    )
    redis.add_argument("action", choices=["start", "stop", "status", "acl"])
    redis.add_argument("--apply", action="store_true", help="acl: install the users on the configured Redis")
    redis.add_argument("--passwords", metavar="FILE", help="acl: role=password lines (made if missing)")
    raas = command("raas", _cmd_raas, "run a RaaS worker: prompts in, rollout groups out")
    trainer = command("trainer", _cmd_trainer, "run the trainer of one policy: batches in, versions out")
    trainer.add_argument("--model", help="the policy to train (default: the run's first trained policy)")
    dataflow = command("dataflow", _cmd_dataflow, "run a dataflow replica: feeder, collector, batches")
    for worker in (raas, trainer, dataflow):  # joining a running run needs no flag
        worker.add_argument("--resume", action="store_true", help="continue a stopped run, or adopt keys")
    health = command("health", _cmd_health, "exit 0 if this host's worker of a role is ready (or alive)")
    health.add_argument("--role", required=True, choices=["raas", "dataflow", "trainer"])
    health.add_argument("--name", help="the worker's consumer name (default: its id, else this host's)")
    health.add_argument("--model", help="trainer: the policy it trains (default: the first trained)")
    health.add_argument("--live", action="store_true", help="liveness: judge only the worker's own signal")
    health.add_argument("--max-idle-s", type=float, help="bound on the consumer's idle s (default: by role)")
    clear = command("clear", _cmd_clear, "delete every Redis key of a run (--run NAME)", recipe=False)
    clear.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    ledger = command("ledger", _cmd_ledger, "print the run's ledger and check it balances (exit 1 if not)")
    ledger.add_argument("--json", action="store_true", help="machine-readable output")
    scale = command("scale", _cmd_scale, "how many RaaS workers the run needs, and why (--serve: for KEDA)")
    scale.add_argument("--headroom", type=float, default=1.2, help="margin over the demand (default 1.2)")
    scale.add_argument("--window", type=int, default=20, help="recent trainer steps measured (default 20)")
    scale.add_argument("--serve", type=int, metavar="PORT", help="serve Prometheus gauges on PORT, refreshed")
    scale.add_argument("--bind", default="0.0.0.0", help="--serve: address to listen on (default all)")
    scale.add_argument("--interval", type=float, default=5.0, help="--serve: seconds between refreshes")
    push = command("workflow", _cmd_workflow, "push a workflow class to a running run's RaaS", False)
    push.add_argument("action", choices=["push"])
    push.add_argument("ref", metavar="module:Class", help="the RolloutWorkflow subclass to push")
    push.add_argument("--name", help="the name prompt groups use (default: module:Class)")
    push.add_argument("--recipe", help="recipe YAML (for the run's settings)")
    trace = command("trace", _cmd_trace, "show the path of one prompt group", recipe=False)
    trace.add_argument("uid", help="the prompt group's uid (e.g. e0r123)")
    trace.add_argument("--recipe", help="recipe YAML (for the run's models)")
    model = sub.add_parser("model", help="build models", description="build models")
    model_sub = model.add_subparsers(metavar="KIND", required=True)
    tiny = model_sub.add_parser("tiny", help="a tiny Qwen2 model and BPE tokenizer, built locally")
    tiny.add_argument("out_dir")
    tiny.add_argument("--warm-start", metavar="TASK", help="add supervised steps on a built-in task")
    tiny.add_argument("--steps", type=int, default=300, help="warm-start steps (default 300)")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(handler=_cmd_model_tiny)
    return p


def _settings(args):
    from astraflow.config import load_settings

    overrides = list(args.set)
    if args.run:
        overrides.append(f"run.name={args.run}")
    if args.redis:
        overrides.append(f"redis.url={args.redis}")
        if "@" in args.redis.split("//", 1)[-1].split("/", 1)[0]:
            print("astraflow: warning: --redis credentials show in ps; use --redis-file", file=sys.stderr)
    recipe = getattr(args, "recipe", None)
    settings = load_settings(recipe, overrides)
    if args.redis_file:  # not on the command line, where `ps` would show its password
        settings.redis.url = Path(args.redis_file).read_text().strip()
    return settings


def _redis_url(settings) -> str:
    """The configured Redis, else the embedded one recorded in the run directory."""
    from astraflow import redis_server
    from astraflow.errors import RedisServerError

    if settings.redis.url or settings.redis.sentinels:  # (with sentinels, they name the primary)
        return settings.redis.url or ""
    server = redis_server.load(settings.run.path / "redis")
    if server is None or not server.alive():
        raise RedisServerError(
            f"no Redis for run {settings.run.name!r}: pass --redis URL or `astraflow redis start --run ...`"
        )
    return server.url


def _cmd_config(args) -> int:
    import yaml

    print(yaml.safe_dump(_settings(args).redacted(), sort_keys=False), end="")
    return 0


def _cmd_redis(args) -> int:
    from astraflow import redis_server

    settings = _settings(args)
    if args.action == "acl":
        from astraflow.streams import acl

        url = _redis_url(settings) if args.apply else None
        return asyncio.run(acl.command(settings, url, Path(args.passwords) if args.passwords else None))
    where = settings.run.path / "redis"
    server = redis_server.load(where)
    if args.action == "start":
        if server is not None and server.alive():
            print(f"already running: {server.display_url} (pid {server.pid})")
            return 0
        server = redis_server.start(where)
        print(
            f"started {server.display_url} (pid {server.pid}, {Path(server.binary).name}); "
            f"password in {where / redis_server.STATE_FILE}"
        )
    elif args.action == "stop":
        if server is None or not server.alive():
            print("not running")
            return 0
        server.stop()
        print(f"stopped pid {server.pid}")
    else:
        alive = server is not None and server.alive()
        print(
            json.dumps(
                {
                    "running": alive,
                    "url": server.display_url if server else None,
                    "pid": server.pid if server else None,
                    "dir": str(where),
                }
            )
        )
        return 0 if alive else 3
    return 0


def _cmd_top(args) -> int:
    settings = _settings(args)
    return asyncio.run(_with_bus(settings, lambda bus: _top(bus, settings)))


async def _top(bus, settings) -> int:
    from rich.live import Live

    from astraflow.launch.progress import Progress, render

    r = settings.run
    progress = Progress(bus, settings.trained, r.reward_window)
    with Live(refresh_per_second=2) as live:
        while True:
            live.update(render(await progress.poll(), r.reward_window, r.target_reward))
            await asyncio.sleep(1.0)


def _cmd_inspect(args) -> int:
    return asyncio.run(_with_bus(_settings(args), _inspect))


async def _inspect(bus) -> int:
    from astraflow.streams.inspect import report

    print(await report(bus))
    return 0


def _cmd_raas(args) -> int:
    from astraflow.launch.services import run_raas
    from astraflow.launch.tiny import build_tiny

    settings = _settings(args)
    url = _joined(args, settings)
    build_tiny(settings)
    run_raas(settings, url)
    return 0


def _cmd_trainer(args) -> int:
    from astraflow.launch.services import run_trainer
    from astraflow.launch.tiny import build_tiny

    settings = _settings(args)
    url = _joined(args, settings)
    build_tiny(settings)
    run_trainer(settings, url, args.model)
    return 0


def _cmd_dataflow(args) -> int:
    from astraflow.launch.services import run_dataflow

    settings = _settings(args)
    run_dataflow(settings, _joined(args, settings))
    return 0


def _joined(args, settings) -> str:
    """The Redis of a worker command, once it may start there: joining the run, or creating it."""
    from astraflow.launch.runs import check_start

    url = _redis_url(settings)
    asyncio.run(check_start(url, settings, fresh=False, resume=args.resume))
    return url


def _cmd_health(args) -> int:
    from astraflow.health import probe

    settings = _settings(args)
    kw = {"name": args.name, "model": args.model, "live": args.live, "max_idle_s": args.max_idle_s}
    healthy, line = asyncio.run(probe(settings, _redis_url(settings), args.role, **kw))
    print(line)
    return 0 if healthy else 1


def _cmd_clear(args) -> int:
    from astraflow.errors import ConfigError
    from astraflow.launch.runs import clear_run

    if not args.run:
        raise ConfigError("name the run to clear: astraflow clear --run NAME")
    settings = _settings(args)
    url = _redis_url(settings)
    return asyncio.run(_with_bus(settings, lambda bus: clear_run(bus, url, args.yes)))


def _cmd_workflow(args) -> int:
    import os

    from astraflow.errors import ConfigError
    from astraflow.workflows.pushed import push

    settings = _settings(args)
    key = settings.raas.push_key
    if key is None or not key.get_secret_value():
        raise ConfigError("pushing a workflow needs the run's push key: set ASTRAFLOW_RAAS__PUSH_KEY")
    if os.getcwd() not in sys.path:  # the user's module, as `python -m` would find it
        sys.path.insert(0, os.getcwd())

    async def run(bus) -> int:
        pushed = await push(bus, key.get_secret_value().encode(), args.ref, args.name)
        print(
            f"pushed {pushed.name} (sha256 {pushed.digest[:16]}, {len(pushed.payload)} bytes) to run "
            f"{settings.run.name!r}; RaaS with raas.accept_pushed_code load it when a group names it"
        )
        return 0

    return asyncio.run(_with_bus(settings, run))


def _cmd_ledger(args) -> int:
    settings = _settings(args)
    return asyncio.run(_with_bus(settings, lambda bus: _ledger(bus, settings, args.json)))


async def _ledger(bus, settings, as_json: bool) -> int:
    from astraflow.dataflow.ledger import read_ledger

    ledger = await read_ledger(bus, settings.trained)
    print(json.dumps(ledger.as_dict(), indent=2) if as_json else ledger.render())
    return 1 if ledger.problems() else 0


def _cmd_scale(args) -> int:
    from astraflow.launch import scaling

    settings = _settings(args)
    if args.serve is None:
        fn = lambda bus: scaling.once(bus, settings, args.headroom, args.window)  # noqa: E731
    else:
        window_s = 12 * args.interval  # the pool's production over the last minute (at 5 s)
        fn = lambda bus: scaling.serve(  # noqa: E731
            bus, settings, args.headroom, args.window, args.serve, args.bind, args.interval, window_s
        )
    return asyncio.run(_with_bus(settings, fn))


def _cmd_trace(args) -> int:
    settings = _settings(args)
    return asyncio.run(_with_bus(settings, lambda bus: _trace(bus, settings, args.uid)))


async def _trace(bus, settings, uid: str) -> int:
    from astraflow.dataflow.ledger import read_trace, render_trace

    trace = await read_trace(bus, uid)
    if trace is None:
        print(f"no trace of prompt group {uid!r} in run {settings.run.name!r} (unknown, or past retention)")
        return 1
    print(render_trace(uid, trace, settings.trained))
    return 0


async def _with_bus(settings, fn) -> int:
    from astraflow.launch.runs import with_bus

    return await with_bus(_redis_url(settings), settings, fn)


def _cmd_model_tiny(args) -> int:
    from astraflow import tiny

    out = tiny.build(args.out_dir, seed=args.seed)
    print(f"built {out}")
    if args.warm_start:
        loss = tiny.warm_start(out, args.warm_start, steps=args.steps, seed=args.seed)
        print(f"warm start on {args.warm_start}: {args.steps} steps, final loss {loss:.3f}")
    return 0


def _cmd_run(args) -> int:
    if args.resume:  # the run's own settings, as it saved them (overrides still apply)
        args.recipe = str(Path(args.resume) / "settings.yaml")
        args.set = [*args.set, f"run.dir={args.resume}"]
    if args.recipe is None:
        args.recipe = DEFAULT_RECIPE
    settings = _settings(args)
    if settings.run.kind == "demo":
        from astraflow.launch import demo

        return demo.main(settings, keep_redis=args.keep_redis)
    from astraflow.launch import launcher

    return launcher.main(settings, keep_redis=args.keep_redis, resume=bool(args.resume))


if __name__ == "__main__":
    sys.exit(main())

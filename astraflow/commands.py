"""The `astraflow` commands that look at or administer a run (top, inspect, ledger, trace, scale, clear,
redis, workflow push, model tiny), and the settings and Redis every command starts from. Imports stay
inside the handlers so `astraflow --help` is instant."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path


def settings_from(args):
    from astraflow.config import load_settings

    overrides = list(args.set)
    if args.run:
        overrides.append(f"run.name={args.run}")
    if getattr(args, "advertise", None):
        overrides.append(f"weights.advertise={args.advertise}")
    if args.redis:
        overrides.append(f"redis.url={args.redis}")
        if "@" in args.redis.split("//", 1)[-1].split("/", 1)[0]:
            print("astraflow: warning: --redis credentials show in ps; use --redis-file", file=sys.stderr)
    recipe = getattr(args, "recipe", None)
    settings = load_settings(recipe, overrides)
    if args.redis_file:  # not on the command line, where `ps` would show its password
        settings.redis.url = _read_url(Path(args.redis_file))
    return settings


def _read_url(path: Path) -> str:
    from astraflow.errors import ConfigError

    try:
        url = path.read_text().strip()
    except OSError as e:
        raise ConfigError(f"--redis-file {path}: cannot read it ({e.strerror})") from None
    if not url:
        raise ConfigError(
            f"--redis-file {path}: empty (it holds the Redis URL: redis://[user:pass@]host:port/db)"
        )
    return url


def redis_url(settings) -> str:
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


def cmd_redis(args) -> int:
    from astraflow import redis_server

    settings = settings_from(args)
    if args.action == "acl":
        from astraflow.streams import acl

        url = redis_url(settings) if args.apply else None
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


def cmd_top(args) -> int:
    settings = settings_from(args)
    return asyncio.run(with_bus(settings, lambda bus: _top(bus, settings), known=True))


async def _top(bus, settings) -> int:
    """The live view on a terminal; elsewhere (a pipe, a log) one plain line every `TOP_LINE_EVERY_S`.
    Times count from the run's creation."""
    from astraflow.launch.progress import Progress, line, render
    from astraflow.streams.runs import existing

    r = settings.run
    identity = await existing(bus)
    started = identity.created if identity is not None else None
    progress = Progress(bus, settings.trained, r.reward_window, started=started)
    if not sys.stdout.isatty():
        while True:
            print(line(await progress.poll(), r.reward_window), flush=True)
            await asyncio.sleep(TOP_LINE_EVERY_S)
    from rich.live import Live

    with Live(refresh_per_second=2) as live:
        while True:
            live.update(render(await progress.poll(), r.reward_window, r.target_reward))
            await asyncio.sleep(1.0)


TOP_LINE_EVERY_S = 5.0


def cmd_inspect(args) -> int:
    return asyncio.run(with_bus(settings_from(args), _inspect))


async def _inspect(bus) -> int:
    from astraflow.streams.inspect import report

    print(await report(bus))
    return 0


def cmd_clear(args) -> int:
    from astraflow.errors import ConfigError
    from astraflow.launch.runs import clear_run

    if not args.run:
        raise ConfigError("name the run to clear: astraflow clear --run NAME")
    settings = settings_from(args)
    if args.unknown_groups:
        return asyncio.run(with_bus(settings, _clear_unknown_groups))
    url = redis_url(settings)
    return asyncio.run(with_bus(settings, lambda bus: clear_run(bus, url, args.yes)))


async def _clear_unknown_groups(bus) -> int:
    from astraflow.streams.inspect import remove_unknown_groups

    removed = await remove_unknown_groups(bus)
    for key, group in removed:
        print(f"removed group {group!r} of {bus.keys.short(key)}")
    print(f"removed {len(removed)} consumer groups that are not the run's; its keys are kept")
    return 0


def cmd_workflow(args) -> int:
    import os

    from astraflow.errors import ConfigError
    from astraflow.workflows.pushed import push

    settings = settings_from(args)
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

    return asyncio.run(with_bus(settings, run, known=True))


def cmd_ledger(args) -> int:
    settings = settings_from(args)
    return asyncio.run(with_bus(settings, lambda bus: _ledger(bus, settings, args.json), known=True))


async def _ledger(bus, settings, as_json: bool) -> int:
    from astraflow.dataflow.ledger import read_ledger

    ledger = await read_ledger(bus, settings.trained)
    print(json.dumps(ledger.as_dict(), indent=2) if as_json else ledger.render())
    return 1 if ledger.problems() else 0


def cmd_scale(args) -> int:
    from astraflow.launch import scaling

    settings = settings_from(args)
    if args.serve is None:
        fn = lambda bus: scaling.once(bus, settings, args.headroom, args.window)  # noqa: E731
    else:
        window_s = 12 * args.interval  # the pool's production over the last minute (at 5 s)
        fn = lambda bus: scaling.serve(  # noqa: E731
            bus, settings, args.headroom, args.window, args.serve, args.bind, args.interval, window_s
        )
    return asyncio.run(with_bus(settings, fn))


def cmd_trace(args) -> int:
    settings = settings_from(args)
    return asyncio.run(with_bus(settings, lambda bus: _trace(bus, settings, args.uid), known=True))


async def _trace(bus, settings, uid: str) -> int:
    from astraflow.dataflow.ledger import read_trace, render_trace

    trace = await read_trace(bus, uid)
    if trace is None:
        print(f"no trace of prompt group {uid!r} in run {settings.run.name!r} (unknown, or past retention)")
        return 1
    print(render_trace(uid, trace, settings.trained))
    return 0


async def with_bus(settings, fn, known: bool = False) -> int:
    """`fn(bus)` on the run's Redis; `known`: only for a run that exists there (else UnknownRunError)."""
    from astraflow.launch.runs import with_bus

    async def checked(bus):
        await require_run(bus)
        return await fn(bus)

    return await with_bus(redis_url(settings), settings, checked if known else fn)


async def require_run(bus) -> None:
    """Raise UnknownRunError, naming the runs this Redis holds, unless run `bus.keys.run` has keys there.
    One try, no reconnects: a command someone waits for says at once that Redis is away."""
    from astraflow.errors import UnknownRunError

    k = bus.keys
    if await bus.redis.exists(k.identity, k.state, k.ledger, k.versions):
        return
    runs = await _run_names(bus)
    held = f" (runs there: {', '.join(runs)})" if runs else ""
    raise UnknownRunError(f"no run {k.run!r} on this Redis{held}: name one with --run NAME")


async def _run_names(bus, most: int = 10) -> list[str]:
    """Up to `most` names of runs on this Redis (from their identity keys); none where the ACL forbids
    SCAN."""
    from redis.exceptions import ResponseError

    names: list[str] = []
    try:
        async for key in bus.redis.scan_iter(match="af:{*}:run", count=1000):
            names.append(key.decode()[len("af:{") : -len("}:run")])
            if len(names) == most:
                break
    except ResponseError:  # NOPERM
        return []
    return sorted(names)


def cmd_model_tiny(args) -> int:
    from astraflow import tiny
    from astraflow.launch.tiny import warm_start_progress

    out = tiny.build(args.out_dir, seed=args.seed)
    print(f"built {out}")
    if args.warm_start:
        progress = warm_start_progress(args.steps)
        loss = tiny.warm_start(out, args.warm_start, steps=args.steps, seed=args.seed, on_step=progress)
        print(f"warm start on {args.warm_start}: {args.steps} steps, final loss {loss:.3f}")
    return 0

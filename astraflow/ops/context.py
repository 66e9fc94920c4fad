"""What every operator command starts from: the settings (recipe, `--set`, `--run`, `--redis`,
`--redis-file`), the run's Redis (the configured one, else the embedded one in the run directory) and a
bus on it; and `astraflow config`, which prints those settings."""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import yaml
from redis.exceptions import ResponseError

from astraflow import redis_server
from astraflow.config import Settings
from astraflow.errors import ConfigError, RedisServerError, UnknownRunError
from astraflow.launch import start_checks
from astraflow.settings_load import load_settings
from astraflow.streams import Bus


def settings_from(args) -> Settings:
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
    try:
        url = path.read_text().strip()
    except OSError as e:
        raise ConfigError(f"--redis-file {path}: cannot read it ({e.strerror})") from None
    if not url:
        raise ConfigError(
            f"--redis-file {path}: empty (it holds the Redis URL: redis://[user:pass@]host:port/db)"
        )
    return url


def redis_url(settings: Settings) -> str:
    """The configured Redis, else the embedded one recorded in the run directory."""
    if settings.redis.url or settings.redis.sentinels:  # (with sentinels, they name the primary)
        return settings.redis.url or ""
    server = redis_server.load(settings.run.path / "redis")
    if server is None or not server.alive():
        raise RedisServerError(
            f"no Redis for run {settings.run.name!r}: pass --redis URL or `astraflow redis start --run ...`"
        )
    return server.url


async def with_bus(settings: Settings, fn: Callable[[Bus], Awaitable[int]], known: bool = False) -> int:
    """`fn(bus)` on the run's Redis; `known`: only for a run that exists there (else UnknownRunError)."""

    async def checked(bus: Bus) -> int:
        await require_run(bus)
        return await fn(bus)

    return await start_checks.with_bus(redis_url(settings), settings, checked if known else fn)


async def require_run(bus: Bus) -> None:
    """Raise UnknownRunError, naming the runs this Redis holds, unless run `bus.keys.run` has keys there.
    One try, no reconnects: a command someone waits for says at once that Redis is away."""
    k = bus.keys
    if await bus.redis.exists(k.identity, k.state, k.ledger, k.versions):
        return
    names = await _run_names(bus)
    held = f" (runs there: {', '.join(names)})" if names else ""
    raise UnknownRunError(f"no run {k.run!r} on this Redis{held}: name one with --run NAME")


async def _run_names(bus: Bus, most: int = 10) -> list[str]:
    """Up to `most` names of runs on this Redis (from their identity keys); none where the ACL forbids
    SCAN."""
    names: list[str] = []
    try:
        async for key in bus.redis.scan_iter(match="af:{*}:run", count=1000):
            names.append(key.decode()[len("af:{") : -len("}:run")])
            if len(names) == most:
                break
    except ResponseError:  # NOPERM
        return []
    return sorted(names)


def cmd_config(args) -> int:
    """`astraflow config`: the effective settings (secrets masked)."""
    print(yaml.safe_dump(settings_from(args).redacted(), sort_keys=False), end="")
    return 0

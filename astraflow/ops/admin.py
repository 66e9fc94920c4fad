"""Commands that change what a Redis holds for a run: `astraflow redis` (the embedded redis-server, the
run's ACL users), `astraflow clear` (every key of a run, or only consumer groups that are not its own)
and `astraflow workflow push` (a workflow class for the run's RaaS)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from astraflow import redis_server
from astraflow.config import redact_url
from astraflow.errors import ConfigError
from astraflow.ops.context import redis_url, settings_from, with_bus
from astraflow.streams import Bus, acl_users
from astraflow.streams.identity import clear, keys_of
from astraflow.streams.views import remove_unknown_groups
from astraflow.workflows.pushed import push


def cmd_redis(args) -> int:
    settings = settings_from(args)
    if args.action == "acl":
        url = redis_url(settings) if args.apply else None
        pw_file = Path(args.passwords) if args.passwords else None
        raas_ids = tuple(i for i in (args.raas_ids or "").split(",") if i)
        return asyncio.run(acl_users.command(settings, url, pw_file, raas_ids))
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


def cmd_clear(args) -> int:
    if not args.run:
        raise ConfigError("name the run to clear: astraflow clear --run NAME")
    settings = settings_from(args)
    if args.unknown_groups:
        return asyncio.run(with_bus(settings, _clear_unknown_groups))
    url = redis_url(settings)
    return asyncio.run(with_bus(settings, lambda bus: clear_run(bus, url, args.yes)))


async def clear_run(
    bus: Bus, url: str, yes: bool, ask: Callable[[str], str] = input, say: Callable[[str], None] = print
) -> int:
    """`astraflow clear`: delete every key of the run, after a confirmation unless `yes`."""
    n = len(await keys_of(bus))
    where = f"run {bus.keys.run!r} ({bus.keys.prefix}*) on {redact_url(url)}"
    if n == 0:
        say(f"nothing to clear: no key of {where}")
        return 0
    if not yes and ask(f"delete {n} keys of {where}? [y/N] ").strip().lower() not in ("y", "yes"):
        say("not cleared")
        return 1
    say(f"deleted {await clear(bus)} keys of {where}")
    return 0


async def _clear_unknown_groups(bus: Bus) -> int:
    removed = await remove_unknown_groups(bus)
    for key, group in removed:
        print(f"removed group {group!r} of {bus.keys.short(key)}")
    print(f"removed {len(removed)} consumer groups that are not the run's; its keys are kept")
    return 0


def cmd_workflow(args) -> int:
    settings = settings_from(args)
    key = settings.raas.push_key
    if key is None or not key.get_secret_value():
        raise ConfigError("pushing a workflow needs the run's push key: set ASTRAFLOW_RAAS__PUSH_KEY")
    if os.getcwd() not in sys.path:  # the user's module, as `python -m` would find it
        sys.path.insert(0, os.getcwd())

    async def run(bus: Bus) -> int:
        pushed = await push(bus, key.get_secret_value().encode(), args.ref, args.name)
        print(
            f"pushed {pushed.name} (sha256 {pushed.digest[:16]}, {len(pushed.payload)} bytes) to run "
            f"{settings.run.name!r}; RaaS with raas.accept_pushed_code load it when a group names it"
        )
        return 0

    return asyncio.run(with_bus(settings, run, known=True))

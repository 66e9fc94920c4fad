"""Runs from the command line: a bus for one command, the start checks, `astraflow clear`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from astraflow.config import Settings, redact_url
from astraflow.streams import Bus
from astraflow.streams.runs import RunIdentity, clear, keys_of, open_run


async def with_bus(url: str, settings: Settings, fn: Callable[[Bus], Awaitable]):
    """`fn(bus)` on a bus of the run, closed afterwards."""
    bus = Bus.connect(url, settings.run.name, settings.redis, settings.streams)
    try:
        return await fn(bus)
    finally:
        await bus.close()


async def check_start(url: str, settings: Settings, *, fresh: bool, resume: bool) -> RunIdentity:
    """The run's identity if this process may start as asked (see `streams.runs.open_run`)."""
    return await with_bus(url, settings, lambda bus: open_run(bus, fresh=fresh, resume=resume))


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

"""Starting a process on a run: a bus for one command, and the start checks of the launcher and of a
worker command (`streams.identity.open_run`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator

from astraflow.config import Settings
from astraflow.streams import Bus
from astraflow.streams.identity import RunIdentity, existing, forget, open_run


async def with_bus(url: str, settings: Settings, fn: Callable[[Bus], Awaitable]):
    """`fn(bus)` on a bus of the run, closed afterwards."""
    bus = Bus.connect(url, settings.run.name, settings.redis, settings.streams)
    try:
        return await fn(bus)
    finally:
        await bus.close()


async def check_start(url: str, settings: Settings, *, fresh: bool, resume: bool) -> RunIdentity:
    """The run's identity if this process may start as asked (see `streams.identity.open_run`)."""
    return await with_bus(url, settings, lambda bus: open_run(bus, fresh=fresh, resume=resume))


@contextlib.contextmanager
def worker_start(url: str, settings: Settings, resume: bool) -> Iterator[None]:
    """A worker command's life on the run: join it (or create it: `streams.identity.open_run`) before the
    body; if the body fails and this process created the run's identity, delete it again
    (`streams.identity.forget`), so a failed start leaves no run behind that a fresh `astraflow run` of that
    name would be refused for."""

    async def join(bus: Bus) -> RunIdentity | None:
        before = await existing(bus)
        identity = await open_run(bus, fresh=False, resume=resume)
        return identity if before is None else None

    created = asyncio.run(with_bus(url, settings, join))
    try:
        yield
    except BaseException:
        if created is not None:
            with contextlib.suppress(Exception):  # the start's own error is the one to report
                asyncio.run(with_bus(url, settings, lambda bus: forget(bus, created)))
        raise

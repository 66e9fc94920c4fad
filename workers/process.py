"""What every worker process does around its loop: logging, a stop event set by SIGTERM/SIGINT, a bus."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable

from astraflow import logs
from astraflow.config import Settings
from astraflow.streams import Bus
from astraflow.streams.memory import warn_if_evicting


async def run_until_signalled(
    settings: Settings, url: str, worker: str, body: Callable[[Bus, asyncio.Event], Awaitable[None]]
) -> None:
    """Run `body(bus, stop)`; SIGTERM or SIGINT sets `stop` (the body finishes and returns)."""
    logs.configure(worker=worker, run=settings.run.name)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    bus = Bus.connect(url, settings.run.name, settings.redis, settings.streams)
    try:
        await warn_if_evicting(bus)
        await body(bus, stop)
    finally:
        await bus.close()

"""What every worker process does around its loop: logging, a stop event set by SIGTERM/SIGINT, a bus."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import socket
from collections.abc import Awaitable, Callable

from astraflow import logs
from astraflow.config import Settings
from astraflow.streams import Bus
from astraflow.streams.memory import warn_if_evicting
from astraflow.streams.names import hold_name


def process_name(kind: str, configured: str | None = None) -> str:
    """`configured`, else `<kind>-<host>-<pid>-<4 hex>`: unique to this process start (pids repeat across
    container restarts), so a new process never mistakes its predecessor's pending entries for entries it
    merely lost track of, and still readable in `redis-cli XINFO CONSUMERS`."""
    return configured or f"{name_prefix(kind)}{os.getpid()}-{secrets.token_hex(2)}"


def name_prefix(kind: str) -> str:
    """How every default name of a `kind` process on this host starts (`astraflow health` finds it so)."""
    return f"{kind}-{socket.gethostname()}-"


async def run_until_signalled(
    settings: Settings,
    url: str,
    worker: str,
    body: Callable[[Bus, asyncio.Event], Awaitable[None]],
    name_setting: str,
) -> None:
    """Run `body(bus, stop)`; SIGTERM or SIGINT sets `stop` (the body finishes and returns). The bus waits
    out Redis outages (logging `redis_unreachable`) rather than ending the process. The process holds its
    consumer name `worker` throughout (`names.hold_name`; `name_setting` is what a clash should change)."""
    logs.configure(worker=worker, run=settings.run.name)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    bus = Bus.connect(url, settings.run.name, settings.redis, settings.streams, wait_out=True)
    try:
        await warn_if_evicting(bus)
        async with hold_name(bus, worker, name_setting):
            await body(bus, stop)
    finally:
        await bus.close()

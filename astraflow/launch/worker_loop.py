"""What every worker process does around its loop: logging, a stop event set by SIGTERM/SIGINT, a bus."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import socket
from collections.abc import Awaitable, Callable

import structlog

from astraflow import logs, processes
from astraflow.config import Settings
from astraflow.launch.stops import follow_run
from astraflow.streams import Bus
from astraflow.streams.memory import warn_if_evicting
from astraflow.streams.names import hold_name

log = structlog.get_logger(__name__)
STOP_MARGIN_S = 30.0


def stop_grace_s(settings: Settings) -> float:
    """How long a stopping worker may take before it is killed: a RaaS's grace for its in-flight groups
    (`raas.grace_s`) plus a margin for what follows it (its release, a trainer's last checkpoint)."""
    return settings.raas.grace_s + STOP_MARGIN_S


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
    role: str,
    judge: bool = False,
) -> None:
    """Run `body(bus, stop)`; SIGTERM or SIGINT sets `stop` (the body finishes and returns), and so does
    the run's stop notice (`launch.stops.follow_run`; `judge`: this process also judges the run's stop
    conditions). The bus waits
    out Redis outages (logging `redis_unreachable`) rather than ending the process. The process holds its
    consumer name `worker` of `role` throughout (`names.hold_name`; `name_setting` is what a clash should
    change).
    A worker whose parent died (the launcher killed: its workers get SIGTERM) ends a stop that overruns
    `stop_grace_s` itself, as the launcher would have: its Redis may have died with the launcher."""
    logs.configure(settings.log.level, worker=worker, run=settings.run.name)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    bus = Bus.connect(url, settings.run.name, settings.redis, settings.streams, wait_out=True)
    at = bus.redis.connection_pool.connection_kwargs
    redis_at = (at["host"], int(at["port"])) if "host" in at and "port" in at else None  # not a socket
    handler = stopper(stop, loop, stop_grace_s(settings), redis_at)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, handler)
    try:
        await warn_if_evicting(bus)
        async with hold_name(bus, worker, name_setting, role=role):
            following = asyncio.create_task(follow_run(bus, settings, stop, judge, role))
            try:
                await body(bus, stop)
            finally:
                following.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await following
    finally:
        await bus.close()


def stopper(
    stop: asyncio.Event,
    loop: asyncio.AbstractEventLoop,
    grace_s: float,
    redis_at: tuple[str, int] | None = None,
) -> Callable[[], None]:
    """The stop signals' handler: sets `stop`. In a worker started to die with its parent (the launcher's)
    whose parent has died, it also ends the process once the stop overruns `grace_s`, as the launcher
    would have (however often the signal comes, and though a stop had begun before), and sooner once
    nothing listens at `redis_at` any more (the embedded Redis died with the launcher: no stop can finish,
    and the leases hand back whatever this worker held)."""
    parent, timer = os.getppid(), None

    def redis_gone() -> None:
        if _refused(*redis_at):  # type: ignore[misc]
            log.error("stop_abandoned", detail="the parent and its Redis are gone: nothing can finish")
            os._exit(1)
        loop.call_later(1.0, redis_gone)

    def stopping() -> None:
        nonlocal timer
        stop.set()
        if timer is None and processes.parent_death_signal() and os.getppid() != parent:
            timer = loop.call_later(grace_s, _overran, grace_s)
            if redis_at is not None:
                loop.call_later(1.0, redis_gone)

    return stopping


def _refused(host: str, port: int) -> bool:
    """Whether a connection to `host:port` is refused (nothing listens); a timeout or another error is
    no proof the server is gone."""
    try:
        socket.create_connection((host, port), timeout=0.2).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    return False


def _overran(grace_s: float) -> None:
    log.error("stop_overran", grace_s=grace_s, detail="the parent is gone: nobody else ends this stop")
    os._exit(1)

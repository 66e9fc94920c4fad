"""`astraflow track`: feed the trackers of a run whose workers were started separately (no launcher)."""

from __future__ import annotations

import asyncio
import signal

from astraflow.errors import ConfigError
from astraflow.ops.context import redis_url, settings_from
from astraflow.streams import Bus
from astraflow.streams.identity import existing
from astraflow.tracking.tracker import open_tracker


def cmd_track(args) -> int:
    settings = settings_from(args)
    if not settings.tracking.sinks:
        raise ConfigError("tracking.sinks: none set (e.g. --set 'tracking.sinks=[tensorboard]')")
    return asyncio.run(_track(settings, redis_url(settings), args.once))


async def _track(settings, url: str, once: bool) -> int:
    """Until SIGINT/SIGTERM or the run is stopped (`--once`: what the stream holds now), then exit 0."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    bus = Bus.connect(url, settings.run.name, settings.redis, settings.streams)
    finished = False
    try:
        tracker = await open_tracker(settings.tracking, bus, settings.run.path, settings.trained)
        try:
            print(f"feeding {', '.join(settings.tracking.sinks)} in {tracker.root}", flush=True)
            while True:
                await tracker.drain()
                identity = await existing(bus)
                finished = identity is None or identity.stopped is not None
                if once or finished or stop.is_set():
                    break
                try:
                    await asyncio.wait_for(stop.wait(), settings.tracking.poll_s)
                except TimeoutError:
                    pass
        finally:
            tracker.close(finished)
        print(f"logged up to entry {tracker.feed.cursor}: {tracker.feed.logged}", flush=True)
        return 0
    finally:
        await bus.close()

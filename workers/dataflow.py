"""A dataflow replica: `astraflow dataflow [RECIPE] --redis URL --run R` or `python -m workers.dataflow`.

Run as many as you like against one Redis; each is stateless and may be killed at any time.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket

from astraflow import logs
from astraflow.config import Settings, load_settings
from astraflow.dataflow.service import Dataflow
from astraflow.streams import Bus


def replica_name(settings: Settings) -> str:
    return settings.dataflow.id or f"dataflow-{socket.gethostname()}-{os.getpid()}"


async def serve(settings: Settings, url: str) -> None:
    name = replica_name(settings)
    logs.configure(worker=name, run=settings.run.name)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    bus = Bus.connect(url, settings.run.name, settings.redis, settings.streams)
    try:
        await Dataflow(settings, bus, name).run(stop)
    finally:
        await bus.close()


def main(settings: Settings, url: str) -> None:
    asyncio.run(serve(settings, url))


if __name__ == "__main__":
    s = load_settings()
    main(s, s.redis.url or "")

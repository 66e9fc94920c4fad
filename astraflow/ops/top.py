"""`astraflow top`: the live progress of a run, also of one started elsewhere (`--redis URL --run NAME`),
read from Redis alone (`launch.progress`)."""

from __future__ import annotations

import asyncio
import sys

from astraflow.config import Settings
from astraflow.launch.progress import Progress, line, render
from astraflow.ops.context import settings_from, with_bus
from astraflow.streams import Bus
from astraflow.streams.identity import existing

TOP_LINE_EVERY_S = 5.0
"""How often `top` prints a line when its output is not a terminal."""


def cmd_top(args) -> int:
    settings = settings_from(args)
    return asyncio.run(with_bus(settings, lambda bus: top(bus, settings), known=True))


async def top(bus: Bus, settings: Settings) -> int:
    """The live view on a terminal; elsewhere (a pipe, a log) one plain line every `TOP_LINE_EVERY_S`.
    Times count from the run's creation."""
    r = settings.run
    identity = await existing(bus)
    started = identity.created if identity is not None else None
    progress = Progress(bus, settings.trained, r.reward_window, started=started)
    if not sys.stdout.isatty():
        while True:
            print(line(await progress.poll(), r.reward_window), flush=True)
            await asyncio.sleep(TOP_LINE_EVERY_S)
    from rich.live import Live  # a terminal's view only

    with Live(refresh_per_second=2) as live:
        while True:
            live.update(render(await progress.poll(), r.reward_window, r.target_reward))
            await asyncio.sleep(1.0)

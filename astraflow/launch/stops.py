"""When a run ends: its stop conditions (`run.target_reward`, `run.max_steps`, `run.max_time_s`), judged
from the metrics stream, and the stop notice every process of the run follows.

`astraflow run` judges the conditions for the workers it starts and stops them itself. Workers started on
their own (`astraflow dataflow|trainer|raas` against a shared Redis) do it between them: the dataflow and
the trainer judge the conditions their settings carry, and the first to find one met records it in the
run's stop notice (`streams.identity.mark_stopped`: `stopped` and `stop_reason`); every worker, the RaaS too,
follows that notice and stops as it would on SIGTERM. The RaaS's ACL user may not read the metrics
stream, so it only follows. `max_time_s` counts from the run's creation, whoever created it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import structlog

from astraflow.config import RunSettings, Settings
from astraflow.launch.progress import Progress
from astraflow.streams import Bus
from astraflow.streams.identity import existing, mark_stopped, stop_key

log = structlog.get_logger(__name__)
FOLLOW_EVERY_S = 1.0
"""How often a worker looks at the run's stop notice (and its stop conditions)."""
EXIT_TARGET_MISSED = 3
"""The run reached `run.max_steps` or `run.max_time_s` before its `run.target_reward`: it ran as asked,
its report is whole, but it did not get where it was sent (a limit alone, without a target, is a 0)."""


def has_conditions(r: RunSettings) -> bool:
    return any(x is not None for x in (r.target_reward, r.max_steps, r.max_time_s))


def reached(steps: list, window: int, target: float, recent: int = 200) -> bool:
    """Whether the moving reward reached `target` at any of the last `recent` steps (more arrive between
    two checks than one: the average may cross the target and fall back meanwhile)."""
    rewards = [r for _, _, r in steps]
    first = max(window, len(rewards) - recent + 1)
    return any(sum(rewards[i - window : i]) / window >= target for i in range(first, len(rewards) + 1))


def stop_reason(r: RunSettings, progress: Progress) -> tuple[str, int] | None:
    """The stop condition met, if any, and the exit status it gives (`astraflow run`'s)."""
    models = progress.models.values()
    target, window = r.target_reward, r.reward_window
    if target is not None and all(reached(m.steps, window, target) for m in models):
        return f"reward target {r.target_reward} reached", 0
    limit = 0 if target is None else EXIT_TARGET_MISSED
    if r.max_steps is not None and all(m.steps and m.steps[-1][0] >= r.max_steps for m in models):
        return f"{r.max_steps} steps", limit
    if r.max_time_s is not None and time.time() - progress.started >= r.max_time_s:
        return f"time limit {r.max_time_s:.0f}s", limit
    return None


async def follow_run(bus: Bus, settings: Settings, stop: asyncio.Event, judge: bool) -> None:
    """Until `stop`: set it when the run is stopped by anyone; with `judge` (and a stop condition in the
    settings), stop the run for everyone once a condition is met. A process `astraflow run` started
    (`run.supervised`) does neither: the launcher stops it."""
    r = settings.run
    if r.supervised:
        return
    progress = None
    while not stop.is_set():
        identity = await existing(bus)
        if identity is not None and identity.stopped is not None:
            log.info("run_stopped", reason=await stopped_reason(bus))
            stop.set()
            return
        if judge and identity is not None and has_conditions(r):
            if progress is None:
                progress = Progress(bus, settings.trained, r.reward_window, started=identity.created)
            await progress.read_metrics()
            met = stop_reason(r, progress)
            if met is not None:
                await mark_stopped(bus, met[0])
                log.info("stop_condition_met", reason=met[0])
                stop.set()
                return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), FOLLOW_EVERY_S)


async def stopped_reason(bus: Bus) -> str | None:
    """Why the run was stopped, as whoever stopped it said (None when it did not say, or is not
    stopped)."""
    reason = await bus.call(lambda: bus.redis.hget(stop_key(bus), "stop_reason"))
    return reason.decode() if reason else None

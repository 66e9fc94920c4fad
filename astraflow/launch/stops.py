"""When a run ends: its stop conditions (`run.target_reward`, `run.max_steps`, `run.max_time_s`), judged
from the metrics stream, and the stop notice every process of the run follows.

`astraflow run` judges the conditions for the workers it starts and stops them itself, and a stop notice
it did not write is a claim it checks against its own reading of the metrics (`stopped_elsewhere`); it
also ends a run whose every group is dead-lettered (`AllDead`). Workers started on their own (`astraflow
dataflow|trainer|raas` against a shared Redis) do it between them: the dataflow and the trainer judge the
conditions their settings carry (the reward target only the trainer: TARGET_JUDGES), and the first to find
one met records it in the run's stop notice (`streams.identity.mark_stopped`: `stopped`, `stop_reason`,
`stopped_by`); every worker, the RaaS too, follows that notice and stops as it would on SIGTERM. The
RaaS's ACL user may not read the metrics stream, so it only follows. `max_time_s` counts from the run's
creation, whoever created it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import structlog

from astraflow.config import RunSettings, Settings
from astraflow.dataflow.ledger import Ledger
from astraflow.errors import DecodeError
from astraflow.launch.progress import Progress
from astraflow.streams import Bus
from astraflow.streams.identity import existing, mark_stopped
from astraflow.streams.records import DeadLetterRecord, decode_record
from astraflow.streams.schema import StopNotice

log = structlog.get_logger(__name__)
FOLLOW_EVERY_S = 1.0
"""How often a worker looks at the run's stop notice (and its stop conditions)."""
EXIT_TARGET_MISSED = 3
"""The run reached `run.max_steps` or `run.max_time_s` before its `run.target_reward`: it ran as asked,
its report is whole, but it did not get where it was sent (a limit alone, without a target, is a 0)."""
EXIT_STOPPED_ELSEWHERE = 4
"""Someone else wrote the run's stop notice, and the launcher's own reading of the metrics does not bear
out a stop condition: the run did not end as its recipe asked, whatever reason the notice gives."""
EXIT_ALL_DEAD = 5
"""`run.stop_after_dead_groups` prompt groups in a row were dead-lettered, none collected: the run could
never reach a target or a step limit, and without a time limit it would never end."""
TARGET_JUDGES = frozenset({"launcher", "trainer"})
"""Who may end a run as "reward target reached": the processes that read the trainers' own steps. The
dataflow judges only the limits (its user may write the notice, and it stands nearer the rollouts)."""


def has_conditions(r: RunSettings) -> bool:
    return any(x is not None for x in (r.target_reward, r.max_steps, r.max_time_s))


def reached(steps: list, window: int, target: float, recent: int = 200) -> bool:
    """Whether the moving reward reached `target` at any of the last `recent` steps (more arrive between
    two checks than one: the average may cross the target and fall back meanwhile)."""
    rewards = [r for _, _, r in steps]
    first = max(window, len(rewards) - recent + 1)
    return any(sum(rewards[i - window : i]) / window >= target for i in range(first, len(rewards) + 1))


def stop_reason(r: RunSettings, progress: Progress, target: bool = True) -> tuple[str, int] | None:
    """The stop condition met, if any, and the exit status it gives (`astraflow run`'s); the reward target
    only with `target`."""
    models = progress.models.values()
    window = r.reward_window
    if (
        target
        and r.target_reward is not None
        and all(reached(m.steps, window, r.target_reward) for m in models)
    ):
        return f"reward target {r.target_reward} reached", 0
    limit = 0 if r.target_reward is None else EXIT_TARGET_MISSED
    if r.max_steps is not None and all(m.steps and m.steps[-1][0] >= r.max_steps for m in models):
        return f"{r.max_steps} steps", limit
    if r.max_time_s is not None and time.time() - progress.started >= r.max_time_s:
        return f"time limit {r.max_time_s:.0f}s", limit
    return None


async def follow_run(bus: Bus, settings: Settings, stop: asyncio.Event, judge: bool, by: str = "") -> None:
    """Until `stop`: set it when the run is stopped by anyone; with `judge` (and a stop condition in the
    settings), stop the run for everyone once a condition is met, recording `by` (the role) in the
    notice; the reward target only when `by` is one of TARGET_JUDGES. A process `astraflow run` started
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
            met = stop_reason(r, progress, target=by in TARGET_JUDGES)
            if met is not None:
                await mark_stopped(bus, met[0], by)
                log.info("stop_condition_met", reason=met[0])
                stop.set()
                return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), FOLLOW_EVERY_S)


async def stopped_reason(bus: Bus) -> str | None:
    """Why the run was stopped, as whoever stopped it said (None when it did not say, or is not
    stopped)."""
    return (await stop_notice(bus))[0]


async def stop_notice(bus: Bus) -> tuple[str | None, str | None]:
    """(reason, by whom) as the stop notice says (None where it does not): what its writer claims, for
    display; `stopped_elsewhere` is the verdict a launcher gives it."""
    key = bus.keys.stop  # (HGET each: the one command on it every role's user may send)
    reason = await bus.call(lambda: bus.redis.hget(key, StopNotice.stop_reason))
    by = await bus.call(lambda: bus.redis.hget(key, StopNotice.stopped_by))
    return _text(reason), _text(by)


def _text(value: bytes | None, limit: int = 200) -> str | None:
    """A notice's field as it is shown: printable characters only (anyone who may write the notice
    writes it), at most `limit` of them."""
    text = value.decode(errors="replace")[:limit] if value else None
    return "".join(c if c.isprintable() else "?" for c in text) if text else None


async def stopped_elsewhere(bus: Bus, r: RunSettings, progress: Progress) -> tuple[str, int] | None:
    """When someone else stopped the run: the launcher's verdict and exit status. A stop condition its
    own reading of the metrics finds met (read again now: the judge may have seen a step first) gives
    that condition's; else the notice's reason is reported as a claim, with EXIT_STOPPED_ELSEWHERE."""
    identity = await existing(bus)
    if identity is None or identity.stopped is None:
        return None
    await progress.read_metrics()
    met = stop_reason(r, progress)
    if met is not None:
        return met
    reason, by = await stop_notice(bus)
    return (
        f"stopped elsewhere by {by or 'an unnamed writer'}: {reason or 'no reason given'}",
        EXIT_STOPPED_ELSEWHERE,
    )


class AllDead:
    """The launcher's watch for a run whose every prompt group is dead-lettered: `limit` groups dead in a
    row (counted from the ledger: dead-lettered since the count of collected groups last moved)."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self._since: tuple[int, int] | None = None
        """(collected, dead) when collected groups last moved (or at the first look)."""

    async def check(self, bus: Bus, ledger: Ledger | None) -> tuple[str, int] | None:
        """The verdict, with the last dead letter's reason, once `limit` groups died in a row."""
        if ledger is None or self.limit is None:
            return None
        if self._since is None or ledger.collected != self._since[0]:
            self._since = (ledger.collected, ledger.dead)
        dead = ledger.dead - self._since[1]
        if dead < self.limit:
            return None
        last = await bus.call(lambda: bus.redis.xrevrange(bus.keys.dead, count=1))
        why = None
        with contextlib.suppress(DecodeError):
            letter = decode_record(last[0][1]) if last else None
            why = _text(letter.reason.encode()) if isinstance(letter, DeadLetterRecord) else None
        reason = f"every prompt group dead-lettered ({dead} in a row, none collected); the last: {why}"
        return reason, EXIT_ALL_DEAD

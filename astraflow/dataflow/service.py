"""One dataflow replica: feeder, collector, batch former and version barrier, each its own loop.

Every step is one atomic Redis script, so replicas need no coordination and a replica may be killed at
any instant: what it read and did not settle stays pending in its consumer group and is taken back by a
restart under the same name, or by any other replica once the lease lapses.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import structlog

from astraflow.dataflow.barrier import Barrier
from astraflow.dataflow.collector import Collector
from astraflow.dataflow.evaluation import Evals, EvalSettings
from astraflow.dataflow.feeder import Feeder
from astraflow.dataflow.settings import DataflowSettings
from astraflow.dataflow.store import Store
from astraflow.errors import describe
from astraflow.streams import Bus
from astraflow.streams.connection import cancel_and_wait, raise_if_cancelled
from astraflow.streams.reap import Reaper
from astraflow.streams.repair import repair
from astraflow.streams.trim import trim
from astraflow.workflows.api import check_row_rewards
from astraflow.workflows.datasets import load_rows

log = structlog.get_logger(__name__)
IDLE_S = 0.1
"""Pause of the batch former when it has nothing to do (woken early by this replica's collector when it
made enough groups ready, or made any while the prefetch is full); what other replicas collected, and
groups gone stale while waiting, are taken in at the latest then."""
FULL_RECHECK_S = 0.5
"""How long the former leaves a model whose prefetch was full, unless this replica records a version first
(its trainer took a batch then): a full prefetch stays full until a trainer reads, and the collector
settles many times a step."""


@dataclasses.dataclass(frozen=True)
class DataflowSetup:
    """What a dataflow replica gets of the run's settings (assembled by `launch.build.dataflow_setup`)."""

    dataflow: DataflowSettings
    models: tuple[str, ...]
    """Every policy of the run (a prompt group names them all)."""
    trained: tuple[str, ...]
    """The policies trained in this run: each has a ready set, batches and a part of the ledger."""
    seed: int
    """The run's seed: the dataset's shuffle and the curators' draws."""
    sync: bool
    """Lockstep (`trainer.mode: sync`): every group from the current weights."""
    named_code: frozenset[str]
    """The `module:Name` code the recipe names, the only code a dataset row may pick by name."""
    eval: EvalSettings = dataclasses.field(default_factory=EvalSettings)
    """What is evaluated at eval versions (none when `eval.every` and `eval.every_s` are 0)."""
    model_paths: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Each policy's starting weights (`Settings.policy(name).engine.model`): the collector checks token
    ids against their vocabulary."""


class BatchFormer:
    def __init__(self, store: Store) -> None:
        self.store = store
        b = store.settings.batch
        self._randoms = min(round(b.replay_ratio * b.size), b.replay_capacity)
        self._groups = b.unit == "groups"
        self.short: dict[str, int] = {}
        """Per model, the batch units its last step found missing (for that batch on 'wait', for the next
        one after 'ok'); lowered by what this replica's collector makes ready since (`made_ready`)."""
        self.full_until: dict[str, float] = {}
        """Per model whose last step found the prefetch full: when to step again at the latest (monotonic;
        `version_recorded` sooner)."""
        self.took: Callable[[], None] = lambda: None
        """Told of every step that took groups out of a ready set (a batch formed, groups expired): the
        feeder's wake-up while the ready sets are full."""

    def made_ready(self, model: str, n_samples: int) -> None:
        """The collector put a group of `model` with `n_samples` samples in its ready set."""
        if model in self.short:
            self.short[model] -= 1 if self._groups else n_samples

    def due(self, model: str) -> bool:
        """Whether a step of `model` may form a batch now, as far as this replica saw: not while too few
        units are ready (a form step is a script of a dozen commands; the collector settles groups many
        times a batch), nor while its prefetch is full."""
        return self.short.get(model, 0) <= 0 and time.monotonic() >= self.full_until.get(model, 0.0)

    def version_recorded(self) -> None:
        """This replica recorded a published version: its trainer is reading its next batch."""
        self.full_until.clear()

    async def step(self, model: str) -> str:
        """Form at most one batch of `model`: 'ok', 'full' (prefetch reached) or 'wait' (too few ready)."""
        randoms = [random.random() for _ in range(self._randoms)]
        status, uid, fresh, replayed, expired, short = await self.store.form(model, randoms)
        self.short[model] = short
        if status == "full":
            self.full_until[model] = time.monotonic() + FULL_RECHECK_S
        else:
            self.full_until.pop(model, None)
        if status == "ok" or expired:
            self.took()
        if expired:
            log.info("groups_expired", model=model, groups=expired)
        if status == "ok":
            log.info("batch_formed", model=model, batch=uid, groups=fresh, replayed=replayed)
        return status


class Dataflow:
    def __init__(
        self, settings: DataflowSetup, bus: Bus, name: str, rows: list[dict[str, Any]] | None = None
    ) -> None:
        self.settings, self.bus, self.name = settings, bus, name
        self.store = Store(bus, settings.dataflow, settings.trained)
        if rows is None:
            rows = load_rows(settings.dataflow.dataset, settings.seed)
        check_row_rewards(rows, settings.named_code)
        e = settings.eval
        evals = Evals(e, settings.dataflow.feeder.workflow, settings.models) if e.every or e.every_s else None
        self.feeder = Feeder(settings, self.store, rows, evals)
        untrained = set(settings.models) - set(settings.trained)
        self.collector = Collector(self.store, name, untrained, e.metrics, settings.model_paths)
        self.barrier = Barrier(self.store, name, synchronous=settings.sync, evals=evals)
        self.former = BatchFormer(self.store)
        self.reaper = Reaper(bus)
        self.collector.made_ready = self.former.made_ready
        self._collected = asyncio.Event()  # the collector settled rollouts: the former may have work
        self._freed = asyncio.Event()  # ... and the feeder may have room
        self._taken = asyncio.Event()  # the former took ready groups (or a version came): room again
        self.former.took = self._taken.set

    async def run(self, stop: asyncio.Event) -> None:
        await self.bus.bootstrap(self.settings.trained)
        loops = [self._feed, self._collect, self._form, self._follow_versions, self._trim]
        tasks = [asyncio.create_task(self._forever(loop)) for loop in loops]
        log.info("dataflow_started", name=self.name, models=self.settings.trained)
        try:
            await stop.wait()
        finally:
            await cancel_and_wait(tasks)
            log.info("dataflow_stopped", name=self.name)

    async def _forever(self, loop: Callable[[], Awaitable[None]]) -> None:
        """Run one loop; an error (Redis away past the reconnect budget) is logged and the loop restarts."""
        while True:
            try:
                await loop()
            except Exception as e:
                raise_if_cancelled()
                log.error("dataflow_loop_failed", loop=loop.__name__, error=describe(e))
                await asyncio.sleep(1.0)

    async def _feed(self) -> None:
        """Submit while there is room; when full, wait for this replica's collector to settle rollouts
        (their prompts' slots are free again: the settle tells the feeder its room too), in sync mode for
        its barrier to record a version (sync mode submits per version), or `interval_ms` (another replica
        did, a RaaS joined), whichever comes first. While the ready sets are full a settle frees nothing:
        then wait for this replica's former to take groups out of them. (In async mode a version frees no
        slot itself, and the barrier submits an eval version's groups.)"""
        interval = self.settings.dataflow.feeder.interval_ms / 1000
        while True:
            self._freed.clear()
            self._taken.clear()
            status, _ = await self.feeder.step()
            if status != "ok":
                await _wait(self._taken if status == "ready" else self._freed, interval)

    async def _collect(self) -> None:
        """Judge the next entries while the last ones are committed (Python and Redis work overlap), at
        most one read per `collector.read_interval_ms`."""
        interval, last = self.store.settings.collector.read_interval_ms / 1000, 0.0
        committing: asyncio.Task | None = None
        try:
            while True:
                await asyncio.sleep(max(0.0, last + interval - time.monotonic()))
                last = time.monotonic()
                n, items = await self.collector.prepare(self.bus.settings.block_ms)
                if committing is not None:
                    try:
                        await committing
                    except Exception as e:  # the entries just read are not settled either: hand them back
                        await self.collector.consumer.give_back([it.entry_id for it in items], e)
                        raise
                limits = self.feeder.limits_used
                committing = asyncio.create_task(self.collector.commit(items, limits)) if n else None
                if committing is not None:  # wake the former and the feeder as soon as it is settled
                    committing.add_done_callback(functools.partial(self._settled, limits))
        finally:
            if committing is not None:
                await cancel_and_wait([committing])

    def _settled(self, limits: tuple[int, int] | None, task: asyncio.Task) -> None:
        if limits is not None and not task.cancelled() and task.exception() is None:
            if (room := task.result()) is not None:
                self.feeder.hint(limits, room)
        if any(map(self.former.due, self.settings.trained)):  # (a wake-up for nothing costs a turn)
            self._collected.set()
        self._freed.set()

    async def _form(self) -> None:
        timed_out = True
        while True:
            for model in self.settings.trained:
                if timed_out or self.former.due(model):
                    while await self.former.step(model) == "ok" and self.former.due(model):
                        pass  # (another batch's worth is ready)
            self._collected.clear()
            timed_out = not await _wait(self._collected, IDLE_S)

    async def _follow_versions(self) -> None:
        while True:
            if await self.barrier.step(self.bus.settings.block_ms):
                if self.settings.sync:  # a new version: the feeder may submit its groups now
                    self._freed.set()
                    self._taken.set()
                self.former.version_recorded()  # a full prefetch has room again
                self._collected.set()

    async def _trim(self) -> None:
        keys = self.bus.keys
        while True:
            await asyncio.sleep(self.bus.settings.trim_interval_ms / 1000)
            for stream in (keys.rollouts, keys.versions, keys.dead):  # (ids forged by a writer)
                await repair(self.bus, stream)
            for stream in keys.reaped_streams():  # (no RaaS may dead-letter: its failed prompts)
                if await self.reaper.sweep(stream):
                    self._freed.set()  # (room in the backlog)
            for stream in (keys.prompts, keys.rollouts, keys.versions, keys.dead):  # (no RaaS may trim)
                await trim(self.bus, stream)


async def _wait(event: asyncio.Event, timeout_s: float) -> bool:
    """Until `event` is set (True) or `timeout_s` passed (False). (Not `asyncio.wait_for`: on Python 3.11
    it makes a task of every wait, and the feeder and the former wait a few dozen times a second.)"""
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        return False
    return True

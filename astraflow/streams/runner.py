"""The consume loop of every worker: bounded concurrency, leases, group-committed hand-offs, dead letters."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence

import structlog

from astraflow.errors import DecodeError, MessageTooLarge
from astraflow.streams.bus import LOST, Entry, Out
from astraflow.streams.consumer import Consumer

Handler = Callable[[Entry], Awaitable[Sequence[Out]]]
log = structlog.get_logger(__name__)


class Runner:
    """Runs `handler` on the entries of `consumer`, at most `capacity` at a time.

    A handler returns the entries to publish; they are published and the input acknowledged in one atomic
    hand-off. Hand-offs that complete while one is in flight are committed together in the next one, so
    a busy worker makes one round trip for many entries. Fault handling is the point of this class:
    - DecodeError or an oversized output: the entry can never succeed, it goes to `dead` at once;
    - any other exception: the entry is released for redelivery and reaches `dead` after max_deliveries;
    - an entry reclaimed by another consumer (our lease lapsed) is cancelled and its output dropped.
    """

    def __init__(self, consumer: Consumer, handler: Handler, capacity: int) -> None:
        self.consumer, self.handler, self.capacity = consumer, handler, capacity
        self.stats: Counter[str] = Counter()
        self._tasks: dict[str, asyncio.Task] = {}
        self._done: list[tuple[Entry, Sequence[Out], asyncio.Future]] = []
        self._wake = asyncio.Event()
        self.log = log.bind(stream=consumer.bus.keys.short(consumer.stream), consumer=consumer.name)

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    async def run(self, stop: asyncio.Event, drain_s: float = 30.0) -> None:
        """Consume until `stop` is set; then finish in-flight entries within `drain_s`, release the rest."""
        settings = self.consumer.bus.settings
        loops = (self._flush_loop(), self._lease_loop(), self._trim_loop())
        helpers = [asyncio.create_task(c) for c in loops]
        try:
            while not stop.is_set():
                free = self.capacity - len(self._tasks)
                if free <= 0:
                    await asyncio.wait([*self._tasks.values()], return_when=asyncio.FIRST_COMPLETED)
                    continue
                block = settings.block_ms if not self._tasks else min(settings.block_ms, 50)
                for entry in await self.consumer.read(free, block):
                    task = asyncio.create_task(self._handle(entry))
                    self._tasks[entry.id] = task
                    task.add_done_callback(lambda _t, i=entry.id: self._tasks.pop(i, None))
            await self._drain(drain_s)
        finally:
            for h in helpers:
                h.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)

    async def _drain(self, drain_s: float) -> None:
        if self._tasks:
            await asyncio.wait([*self._tasks.values()], timeout=drain_s)
        for entry_id, task in list(self._tasks.items()):
            task.cancel()
            entry = self.consumer.in_flight.get(entry_id)
            if entry is not None:
                await self.consumer.release(entry, "worker stopped before finishing it")
                self.stats["released"] += 1
        await self._flush()

    async def _handle(self, entry: Entry) -> None:
        try:
            await self._process(entry)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # Redis gone while settling a failure: the entry will be reclaimed.
            self.log.error("entry_unsettled", id=entry.id, error=repr(e))
            self.consumer.in_flight.pop(entry.id, None)

    async def _process(self, entry: Entry) -> None:
        try:
            outs = await self.handler(entry)
            for out in outs:
                self.consumer.bus.check_size(out)
        except (DecodeError, MessageTooLarge) as e:
            self.log.error("entry_dead_lettered", id=entry.id, error=str(e))
            await self.consumer.dead_letter(entry, f"{type(e).__name__}: {e}")
            self.stats["dead"] += 1
            return
        except Exception as e:
            self.log.warning("entry_failed", id=entry.id, deliveries=entry.deliveries, error=repr(e))
            await self.consumer.release(entry, f"{type(e).__name__}: {e}")
            self.stats["released"] += 1
            return
        done = asyncio.get_running_loop().create_future()
        self._done.append((entry, outs, done))
        self._wake.set()
        await done

    async def _flush_loop(self) -> None:
        while True:
            await self._wake.wait()
            await self._flush()

    async def _flush(self) -> None:
        self._wake.clear()
        batch, self._done = self._done, []
        if not batch:
            return
        try:
            statuses = await self.consumer.complete([(e, outs) for e, outs, _ in batch])
        except Exception as e:  # Redis gone past the reconnect budget: leave the entries to be reclaimed.
            self.log.error("handoff_failed", entries=len(batch), error=repr(e))
            for entry, _, _ in batch:
                self.consumer.in_flight.pop(entry.id, None)
            statuses = ["failed"] * len(batch)
        for (entry, _, done), status in zip(batch, statuses, strict=True):
            self.stats[status] += 1
            if status == LOST:
                self.log.warning("entry_lost", id=entry.id, reason="reclaimed by another consumer")
            if not done.done():
                done.set_result(status)

    async def _lease_loop(self) -> None:
        interval = self.consumer.bus.settings.lease_ms / 3000
        while True:
            await asyncio.sleep(interval)
            try:
                lost = await self.consumer.renew()
            except Exception as e:
                self.log.error("lease_renewal_failed", error=repr(e))
                continue
            for entry in lost:
                self.log.warning("lease_lost", id=entry.id)
                self.stats["lost"] += 1
                task = self._tasks.get(entry.id)
                if task is not None:
                    task.cancel()

    async def _trim_loop(self) -> None:
        bus, stream = self.consumer.bus, self.consumer.stream
        while True:
            await asyncio.sleep(bus.settings.trim_interval_ms / 1000)
            try:
                await bus.trim(stream)
            except Exception as e:
                self.log.warning("trim_failed", error=repr(e))

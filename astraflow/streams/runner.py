"""The consume loop of every worker: bounded concurrency, leases, group-committed hand-offs, dead letters."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence

import structlog

from astraflow.errors import DecodeError, MessageTooLarge, WorkerUnhealthy, describe
from astraflow.streams.connection import cancel_and_wait, raise_if_cancelled
from astraflow.streams.consumer import Consumer
from astraflow.streams.entries import DUP, LOST, OK, Delivery, Out, check_size
from astraflow.streams.trim import trim

Handler = Callable[[Delivery], Awaitable[Sequence[Out]]]
log = structlog.get_logger(__name__)


class Runner:
    """Runs `handler` on the entries of `consumer`, holding at most `capacity` entries at a time.

    A handler returns the entries to publish; they are published and the input acknowledged in one atomic
    hand-off. Results that arrive while a hand-off is in flight are committed together in the next one,
    so a busy worker makes one round trip for many entries. An entry occupies a slot from its delivery
    until its handler returns; up to `capacity` more may wait for their hand-off, so reading the next
    entries overlaps with committing the last ones. Fault handling is the point of this class:
    - DecodeError or an oversized output: the entry can never succeed, it goes to `dead` at once (on a
      stream whose consumers may not dead-letter, `Consumer.dead_letters`, it is released with its reason
      like any failure, and the dataflow dead-letters it after max_deliveries);
    - any other exception: the entry is released for redelivery and reaches `dead` after max_deliveries;
    - an entry reclaimed by another consumer (our lease lapsed) is cancelled and its output dropped;
    - a handler running past `streams.handler_timeout_s` is cancelled and its entry released; the worker
      is then `unhealthy` (a hung handler may hold threads, locks or an engine): `run` stops reading,
      drains and raises WorkerUnhealthy, so the process exits non-zero and its supervisor restarts it.
    """

    def __init__(self, consumer: Consumer, handler: Handler, capacity: int, *, trims: bool = True) -> None:
        self.consumer, self.handler, self.capacity = consumer, handler, capacity
        self.trims = trims
        """Whether it trims its input and the dead letters (`_trim_loop`); a RaaS does not: its user may
        not trim (the dataflow trims `prompts` and `dead`)."""
        self.stats: Counter[str] = Counter()
        self._tasks: dict[str, asyncio.Task] = {}
        """Per held entry: its handler, or the release or dead letter settling its failure."""
        self._started: dict[str, float] = {}  # when each running handler started (loop time), in order
        self._done: list[tuple[Delivery, Sequence[Out]]] = []
        self._committing = 0
        self._wake = asyncio.Event()
        self._freed = asyncio.Event()
        self._commit_lock = asyncio.Lock()
        self.unhealthy: str | None = None
        """Why this worker should be restarted (None while healthy)."""
        self.log = log.bind(stream=consumer.bus.keys.short(consumer.stream), consumer=consumer.name)

    @property
    def held(self) -> int:
        """Entries delivered and not yet handed off."""
        return len(self._tasks) + len(self._done) + self._committing

    @property
    def handed_off(self) -> int:
        """Entries this runner handed off: OK, and DUP (its hand-off went through, the reply was lost and
        the retry found it done)."""
        return self.stats[OK] + self.stats[DUP]

    @property
    def free(self) -> int:
        """Entries to read now: free slots, unless as many finished entries already wait for a hand-off."""
        return min(self.capacity - len(self._tasks), 2 * self.capacity - self.held)

    async def run(self, stop: asyncio.Event, drain_s: float = 30.0) -> None:
        """Consume until `stop` is set; then finish in-flight entries within `drain_s`, release the rest.
        Raises WorkerUnhealthy (after the same drain) once a handler hung."""
        settings = self.consumer.bus.settings
        loops = [
            self._commit_loop(),
            self._lease_loop(),
            *([self._trim_loop()] if self.trims else []),
            self._timeouts(),
            self._watch(stop),
        ]
        helpers = [asyncio.create_task(c) for c in loops]
        try:
            while not stop.is_set() and self.unhealthy is None:
                free = self.free
                if free <= 0:
                    self._freed.clear()
                    await self._freed.wait()
                    continue
                block = settings.block_ms if not self.held else min(settings.block_ms, 50)
                for entry in await self._read_until(stop, free, block):
                    self._start(entry)
            try:
                await asyncio.wait_for(self._drain(drain_s), 2 * drain_s)
            except TimeoutError:  # Redis away: what is not settled stays pending, reclaimed after the lease
                self.log.error("drain_incomplete", held=self.held)
            if self.unhealthy is not None:
                raise WorkerUnhealthy(self.unhealthy)
        finally:
            # Also on an exception or cancellation: no handler outlives the runner. What they held and
            # did not hand off stays pending and is taken back after the lease.
            await cancel_and_wait([*self._tasks.values(), *helpers])

    async def _read_until(self, stop: asyncio.Event, count: int, block_ms: int) -> list[Delivery]:
        """The next entries. A read still waiting for Redis when `stop` is set gets its block time and a
        socket timeout to end, then is abandoned (a worker stops during an outage too): entries it may
        have been given stay pending and are reclaimed after the lease."""
        read = asyncio.ensure_future(self.consumer.read(count, block_ms))
        stopped = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({read, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if not read.done():
                socket_s = self.consumer.bus.settings.block_ms / 1000  # on top of this read's own block
                await asyncio.wait({read}, timeout=block_ms / 1000 + socket_s)
        finally:
            stopped.cancel()
            if not read.done():
                read.cancel()
                self.log.warning("read_abandoned", reason="stopping while redis is unreachable")
        # A task just cancelled is not done until the loop runs it again: its result is nobody's then.
        return read.result() if read.done() and not read.cancelled() else []

    async def _watch(self, stop: asyncio.Event) -> None:
        await stop.wait()
        self._freed.set()

    def _task_done(self, entry_id: str, task: asyncio.Task) -> None:
        if self._tasks.get(entry_id) is task:
            del self._tasks[entry_id]
        self._freed.set()

    async def _drain(self, drain_s: float) -> None:
        if self._tasks:
            await asyncio.wait([*self._tasks.values()], timeout=drain_s)
        for entry_id, task in list(self._tasks.items()):
            task.cancel()
            entry = self.consumer.in_flight.get(entry_id)
            if entry is not None:
                await self._release(entry, "worker stopped before finishing it")
        await self._commit()

    def _start(self, entry: Delivery) -> None:
        """Run the handler on `entry` as a task of its own; `_finished` takes its result."""
        task = asyncio.ensure_future(self.handler(entry))
        self._tasks[entry.id] = task
        self._started[entry.id] = asyncio.get_running_loop().time()
        task.add_done_callback(lambda t: self._finished(entry, t))

    def _finished(self, entry: Delivery, task: asyncio.Task) -> None:
        """A handler ended: its outputs wait for the next hand-off; a failure is settled by a task."""
        if self._tasks.get(entry.id) is not task:  # it timed out: settled by `_timeouts`
            return
        del self._tasks[entry.id], self._started[entry.id]
        self._freed.set()
        if task.cancelled():  # its lease was lost, or the runner is stopping: not ours to settle
            return
        error = task.exception()
        if error is None:
            try:
                outs = task.result()
                for out in outs:
                    check_size(out, self.consumer.bus.settings.max_entry_bytes)
            except Exception as e:
                error = e
            else:
                self._done.append((entry, outs))
                self._wake.set()
                return
        self._settle(entry, self._failed(entry, error))

    def _settle(self, entry: Delivery, settling) -> None:
        """Run `settling` (a release or a dead letter of `entry`) as a task the runner holds and drains."""
        task = asyncio.ensure_future(settling)
        self._tasks[entry.id] = task
        task.add_done_callback(lambda t: self._task_done(entry.id, t))

    async def _failed(self, entry: Delivery, error: BaseException) -> None:
        """An entry that can never succeed goes to `dead` at once where this consumer may dead-letter; any
        other failure releases it."""
        if not (isinstance(error, DecodeError | MessageTooLarge) and self.consumer.dead_letters):
            self.log.warning("entry_failed", id=entry.id, deliveries=entry.deliveries, error=describe(error))
            await self._release(entry, f"{type(error).__name__}: {error}")
            return
        self.log.error("entry_dead_lettered", id=entry.id, error=str(error))
        try:
            await self.consumer.dead_letter(entry, f"{type(error).__name__}: {error}")
            self.stats["dead"] += 1
        except Exception as e:  # Redis gone meanwhile: the next read takes the entry back
            raise_if_cancelled()
            self.log.error("entry_unsettled", id=entry.id, error=describe(e))

    async def _timeouts(self) -> None:
        """Cancel a handler running past `streams.handler_timeout_s` (within a quarter of it, or a second)
        and release its entry, without waiting for the handler: one that ignores cancellation must not
        hold the entry. The worker is unhealthy from then on (see the class)."""
        timeout_s = self.consumer.bus.settings.handler_timeout_s
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(timeout_s / 4, 1.0))
            for entry_id, started in list(self._started.items()):
                if loop.time() - started <= timeout_s:
                    break  # started in order: the rest are younger
                self._tasks.pop(entry_id).cancel()
                del self._started[entry_id]
                self.unhealthy = f"handler timed out after {timeout_s:g} s"
                self.log.error("handler_timed_out", id=entry_id, timeout_s=timeout_s)
                self._freed.set()  # wake the read loop: it stops reading
                entry = self.consumer.in_flight.get(entry_id)
                if entry is not None:
                    self._settle(entry, self._release(entry, self.unhealthy))

    async def _release(self, entry: Delivery, reason: str) -> None:
        try:
            await self.consumer.release(entry, reason)
            self.stats["released"] += 1
        except Exception as e:  # it stays pending and is taken back after the lease
            raise_if_cancelled()
            self.log.error("release_failed", id=entry.id, error=describe(e))

    async def _commit_loop(self) -> None:
        while True:
            await self._wake.wait()
            await self._commit()

    async def _commit(self) -> None:
        """Hand off everything finished so far in one step (serialised: one commit at a time)."""
        async with self._commit_lock:
            self._wake.clear()
            batch, self._done = self._done, []
            if not batch:
                return
            self._committing = len(batch)
            try:
                statuses = await self.consumer.complete(batch)
            except Exception as e:  # taken back at the next read; released (counted) unless Redis was away
                self.log.error("handoff_failed", entries=len(batch), error=describe(e))
                await self.consumer.give_back([entry.id for entry, _ in batch], e)
                statuses = ["failed"] * len(batch)
            finally:
                self._committing = 0
                self._freed.set()
            for (entry, _), status in zip(batch, statuses, strict=True):
                self.stats[status] += 1
                if status == LOST:
                    self.log.warning("entry_lost", id=entry.id, reason="reclaimed, or its read failed over")

    async def _lease_loop(self) -> None:
        interval = self.consumer.bus.settings.lease_ms / 3000
        while True:
            await asyncio.sleep(interval)
            try:
                lost = await self.consumer.renew()
            except Exception as e:
                raise_if_cancelled()
                self.log.error("lease_renewal_failed", error=describe(e))
                continue
            for entry in lost:
                self.log.warning("lease_lost", id=entry.id)
                self.stats["lost"] += 1
                task = self._tasks.get(entry.id)
                if task is not None:
                    task.cancel()

    async def _trim_loop(self) -> None:
        """Trim the input stream up to what every group acknowledged, and the dead letters to length."""
        bus = self.consumer.bus
        while True:
            await asyncio.sleep(bus.settings.trim_interval_ms / 1000)
            try:
                await trim(bus, self.consumer.stream)
                await trim(bus, bus.keys.dead)
            except Exception as e:
                raise_if_cancelled()
                self.log.warning("trim_failed", error=describe(e))

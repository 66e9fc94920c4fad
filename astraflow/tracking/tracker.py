"""One process per run feeds the trackers: `astraflow run`'s launcher, or `astraflow track` for workers
started separately (a cluster has no launcher; the command is a small sidecar next to the dataflow).

One feeder, not each worker, because a step must reach a tracker once, and only the whole stream says
what a step's reward was (the dataflow's rollouts) next to its statistics (the trainer's). The feeder
holds a lock on its directory (a second feeder of it is refused, with the holder's pid) and keeps the
feed's state and stream cursor in `feed.json` there, written after the sinks flushed what it covers: a
restarted feeder goes on after the last entry it logged.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
from pathlib import Path
from typing import IO

import structlog

from astraflow.errors import ConfigError, describe
from astraflow.streams import Bus
from astraflow.streams.identity import existing
from astraflow.tracking.feed import Feed, Record
from astraflow.tracking.settings import TrackingSettings
from astraflow.tracking.sinks import Sink, check_installed, make_sinks

log = structlog.get_logger(__name__)
STATE = "feed.json"
READ_COUNT = 10_000


def tracking_dir(settings: TrackingSettings, run_path: Path) -> Path:
    return settings.dir if settings.dir is not None else run_path / "tracking"


class Tracker:
    """Feeds `sinks` from the run's `metrics` stream; `open` it, `poll` (or `run`), then `close`."""

    def __init__(self, bus: Bus, sinks: list[Sink], root: Path, models: list[str]) -> None:
        self.bus, self.sinks, self.root = bus, sinks, root
        self.feed = Feed(list(models))
        self._lock: IO[str] | None = None

    async def open(self) -> None:
        """Lock the directory, load the saved state; a state of another run (same name, new identity)
        is dropped."""
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = _lock(self.root / ".lock")
        identity = await existing(self.bus)
        if identity is None:
            raise ConfigError(f"no run {self.bus.keys.run!r} on this Redis (nothing to track)")
        path = self.root / STATE
        if path.exists():
            saved = Feed.from_dict(json.loads(path.read_text()))
            if saved.run == identity.nonce:
                self.feed = Feed(
                    self.feed.models, **{k: v for k, v in saved.as_dict().items() if k != "models"}
                )
        self.feed.run = identity.nonce

    async def poll(self) -> int:
        """Log every entry written since the last poll; returns how many were read."""
        reply = await self.bus.call(
            lambda: self.bus.redis.xread({self.bus.keys.metrics: self.feed.cursor}, count=READ_COUNT)
        )
        entries = [
            (i.decode(), {k.decode(): v.decode() for k, v in f.items()})
            for i, f in (reply[0][1] if reply else [])
        ]
        if entries:
            self._log(self.feed.consume(entries))
        return len(entries)

    async def drain(self) -> None:
        while await self.poll() == READ_COUNT:
            pass

    async def run(self, stop: asyncio.Event, poll_s: float) -> None:
        """Poll every `poll_s` until `stop`, then log what is left; a failed poll is logged and retried."""
        while not stop.is_set():
            try:
                await self.drain()
            except Exception as e:  # Redis away: the cursor stays, nothing is lost
                log.warning("tracking_poll_failed", error=describe(e))
            try:
                await asyncio.wait_for(stop.wait(), poll_s)
            except TimeoutError:
                pass
        await self.drain()

    def close(self, finished: bool) -> None:
        """Close the sinks; `finished` (the run has stopped): log the evals it stopped in the middle of."""
        try:
            if finished:
                self._log(self.feed.finish())
            for sink in self.sinks:
                sink.close()
        finally:
            if self._lock is not None:
                self._lock.close()

    def _log(self, records: list[Record]) -> None:
        for policy, step, scalars in records:
            for sink in self.sinks:
                sink.log(policy, step, scalars)
        for sink in self.sinks:
            sink.flush()
        tmp = self.root / f"{STATE}.tmp"  # after the flush: the cursor never runs ahead of the trackers
        tmp.write_text(json.dumps(self.feed.as_dict()))
        tmp.replace(self.root / STATE)


def _lock(path: Path) -> IO[str]:
    f = path.open("a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "?"
        f.close()
        raise ConfigError(f"{path.parent}: already fed by another process (pid {holder})") from None
    f.truncate(0)
    f.write(str(os.getpid()))
    f.flush()
    return f


async def open_tracker(settings: TrackingSettings, bus: Bus, run_path: Path, models: list[str]) -> Tracker:
    root = tracking_dir(settings, run_path)
    check_installed(settings)
    tracker = Tracker(bus, [], root, models)
    await tracker.open()
    tracker.sinks = make_sinks(settings, root, bus.keys.run)
    return tracker


class Following:
    """The launcher's tracker, polling in a task of its event loop (nothing when no sink is set)."""

    def __init__(self, tracker: Tracker | None, poll_s: float) -> None:
        self.tracker, self.stop_event = tracker, asyncio.Event()
        self.task = asyncio.create_task(tracker.run(self.stop_event, poll_s)) if tracker else None

    async def stop(self) -> None:
        """After the workers stopped: log what they wrote last, close the sinks."""
        if self.tracker is None or self.task is None:
            return
        self.stop_event.set()
        try:
            await self.task
            self.tracker.close(finished=True)
        except Exception as e:  # a tracker that fails must not cost the run its report
            log.error("tracking_failed", error=describe(e), dir=str(self.tracker.root))


async def follow(settings, bus: Bus) -> Following:
    """What `astraflow run` calls: `settings` the run's root settings."""
    t = settings.tracking
    tracker = await open_tracker(t, bus, settings.run.path, settings.trained) if t.sinks else None
    return Following(tracker, t.poll_s)

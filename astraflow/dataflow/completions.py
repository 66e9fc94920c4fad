"""What the dataflow has seen each RaaS complete: the measure of a worker's capacity (`Feeder.counted`),
never what the worker reports of itself (a forged heartbeat's `in_flight`, `groups` or `started_at`).

Collectors count the rollout groups they settle 'ok' per worker (`seen`) and add them to the hash
`completed` at most once a second (`flush`): `<worker>` -> groups, `<worker>:since` -> when the dataflow
first counted one of its groups. Worker names come from rollouts, so at most MAX_WORKERS are kept.
"""

from __future__ import annotations

import math
import time
from collections import Counter

from astraflow.streams import Bus

MAX_WORKERS = 4096
"""Worker names counted (a name first seen once this many are kept is not counted)."""
FLUSH_S = 1.0
"""Counts are added to Redis at most this often (one round trip or two)."""
MIN_WINDOW_S = 10.0
"""A worker's rate is its groups over at least this long: one group just collected is no rate."""


def since_field(worker: str) -> str:
    return f"{worker}:since"


class Completions:
    """A collector's counts of the groups it settled per worker, added to `completed` by `flush`."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.pending: Counter[str] = Counter()
        self._flushed_at = 0.0

    def seen(self, worker: str) -> None:
        """Count one group of `worker` collected (settled 'ok')."""
        if worker and (worker in self.pending or len(self.pending) < MAX_WORKERS):
            self.pending[worker] += 1

    async def flush(self, force: bool = False) -> None:
        """Add the counts to Redis, if a second has passed since the last flush (or `force`)."""
        if not self.pending or (not force and time.monotonic() - self._flushed_at < FLUSH_S):
            return
        pending, self.pending, self._flushed_at = self.pending, Counter(), time.monotonic()
        key, redis, now = self.bus.keys.completed, self.bus.redis, f"{time.time():.3f}"
        workers = list(pending)
        known = await self.bus.call(lambda: redis.hmget(key, workers))
        room = MAX_WORKERS - await self.bus.call(lambda: redis.hlen(key)) // 2

        async def add() -> None:
            nonlocal room
            async with redis.pipeline(transaction=False) as pipe:
                for worker, had in zip(workers, known, strict=True):
                    if had is None:
                        if room <= 0:
                            continue
                        room -= 1
                        pipe.hsetnx(key, since_field(worker), now)
                    pipe.hincrby(key, worker, pending[worker])
                await pipe.execute()

        await self.bus.call(add)


def shown_slots(completed: dict[bytes, bytes], worker: str, horizon_s: float, now: float) -> int:
    """The slots `worker` has shown it uses, from `completed` (the hash, as HGETALL gives it): the groups
    the dataflow collected from it per second since it first counted one, times `horizon_s`."""
    count = completed.get(worker.encode())
    since = completed.get(since_field(worker).encode())
    if count is None or since is None:
        return 0
    window_s = max(now - float(since), MIN_WINDOW_S)
    return math.ceil(int(count) / window_s * horizon_s)

"""The feeder: dataset rows -> prompt groups on `prompts`, curated, with back-pressure.

Position p of the dataset stream is row perm_e[p mod N] of epoch e = p div N, perm_e a shuffle seeded by
(run seed, e): any replica computes the same row for the same position. The cursor lives in Redis and
advances in the same atomic step that submits (submit.lua), so replicas never submit a position twice.
"""

from __future__ import annotations

import functools
import hashlib
import math
import random
import time
from typing import TYPE_CHECKING, Any

import structlog

from astraflow.dataflow.completions import shown_slots
from astraflow.dataflow.curators import make_curator
from astraflow.dataflow.steps import Room, SubmitItem
from astraflow.dataflow.store import Store
from astraflow.errors import DecodeError
from astraflow.messages import Heartbeat, PromptGroup, decode, encode
from astraflow.streams.names import heartbeat_holder
from astraflow.streams.runstate import RunState
from astraflow.streams.strays import Strays
from astraflow.streams.views import SCAN_COUNT

if TYPE_CHECKING:
    from astraflow.dataflow.evaluation import Evals
    from astraflow.dataflow.service import DataflowSetup

log = structlog.get_logger(__name__)
STEP_POSITIONS = 32
"""Most dataset positions considered per submit call (up to the one that fills the room)."""
START_SLOTS = 8
"""Slots a heartbeat counts for before its worker has shown it uses more (the RaaS default `slots`)."""


class Feeder:
    def __init__(
        self, settings: DataflowSetup, store: Store, rows: list[dict[str, Any]], evals: Evals | None = None
    ) -> None:
        """`evals`: submits an announced eval version's groups (before any other work)."""
        if not rows:
            raise ValueError("the dataset is empty: nothing to feed")
        self.settings, self.store, self.rows, self.evals = settings, store, rows, evals
        self.bus = store.bus
        self.feeder = settings.dataflow.feeder
        self.curator = make_curator(self.bus, self.feeder)
        self._perm: tuple[int, list[int]] | None = None
        self._pool: tuple[float, int] = (0.0, 0)
        self._refused: set[bytes] = set()
        self.strays = Strays(self.bus)
        self.limits_used: tuple[int, int] | None = None
        """The limits of the last step (`limits`): a settle reads the room under them for the next step."""
        self._hint: tuple[tuple[int, int], Room] | None = None
        self._left: tuple[tuple[int, int], Room] | None = None
        """The room this feeder's last submit left (its cursor the new one), under its limits."""

    def row_at(self, position: int) -> int:
        epoch, offset = divmod(position, len(self.rows))
        if self._perm is None or self._perm[0] != epoch:
            perm = list(range(len(self.rows)))
            random.Random(f"{self.settings.seed}:{epoch}").shuffle(perm)
            self._perm = (epoch, perm)
        return self._perm[1][offset]

    def uid_at(self, position: int) -> str:
        epoch, _ = divmod(position, len(self.rows))
        return f"e{epoch}r{self.row_at(position)}"

    async def pool_slots(self) -> int:
        """Slots of the live RaaS pool (from unexpired heartbeats, each as `counted`), re-read at most
        once a second. A heartbeat not written by the worker holding its name counts for nothing."""
        at, slots = self._pool
        if time.monotonic() - at < 1.0:
            return slots
        redis, slots = self.bus.redis, 0
        pattern = self.bus.keys.raas("*")
        keys = await self.bus.call(lambda: _scan(redis, pattern))
        completed = await self.bus.call(lambda: redis.hgetall(self.bus.keys.completed)) if keys else {}
        now = time.time()
        for key in keys:
            fields = await self.bus.call(lambda k=key: redis.hgetall(k))
            if not fields:
                continue
            try:
                beat = decode(fields, Heartbeat)
            except DecodeError as e:
                log.warning("bad_heartbeat", key=key, error=str(e))
                continue
            if self.bus.keys.raas(beat.uid).encode() != key or not await heartbeat_holder(
                self.bus, beat.uid, fields
            ):
                if key not in self._refused:
                    self._refused.add(key)
                    log.warning("heartbeat_ignored", key=key, reason="not written by the holder of its name")
                continue
            slots += self.counted(beat, completed, now)
        self._pool = (time.monotonic(), slots)
        return slots

    def counted(self, beat: Heartbeat, completed: dict[bytes, bytes], now: float) -> int:
        """Slots `beat` counts for: what it advertises, at most `feeder.max_worker_slots` and at most what
        the dataflow has seen its worker use - the groups collected from it (`completed`, the hash) at its
        rate over `feeder.capacity_horizon_s`, or a new worker's START_SLOTS. Nothing the worker reports of
        its own work counts (a forger reports what it likes), so a forged capacity cannot flood `prompts`,
        and a real worker's count grows as fast as it hands work back."""
        f = self.feeder
        shown = max(START_SLOTS, shown_slots(completed, beat.uid, f.capacity_horizon_s, now))
        return max(0, min(beat.capacity, f.max_worker_slots, shown))

    async def limits(self) -> tuple[int, int]:
        """(backlog limit in prompt groups, ready-set limit in batch units: groups or samples)."""
        f = self.feeder
        backlog = max(f.min_backlog, math.ceil(f.backlog_factor * await self.pool_slots()))
        batch = self.settings.dataflow.batch.size
        ready = math.ceil(f.max_ready_batches * batch) * len(self.settings.trained)
        return backlog, ready

    def hint(self, limits: tuple[int, int], room: Room) -> None:
        """The room a settle read under `limits` just after it (`Store.collect`): the next step takes it
        instead of reading the room again - a round trip less per settle, the usual wake-up."""
        self._hint = (limits, room)

    async def _room(self, limits: tuple[int, int]) -> Room:
        """The room under `limits`: the last hint (taken once), else a read. A hint read before this
        feeder's last submit moved the cursor (a settle that ran first, its reply late) counts the slots
        that submit took: what the submit left is newer then."""
        hint, self._hint = self._hint, None
        if hint is not None and self._left is not None and hint[1].cursor < self._left[1].cursor:
            hint = self._left
        if hint is not None and hint[0] == limits:
            return hint[1]
        return await self.store.room(*limits)

    def _groups_per_batch(self) -> int:
        b = self.settings.dataflow.batch
        return b.size if b.unit == "groups" else math.ceil(b.size / self.feeder.n_samples)

    def _batch_formed(self, state: RunState, version: int) -> bool:
        """Sync mode: whether every model's batch for `version` exists (or no version is announced yet)."""
        if state.notice is None:
            return True
        return all(state.batch_version(m) >= version for m in self.settings.trained)

    async def step(self) -> tuple[str, int]:
        """Consider the next positions; returns (status, groups submitted). Status 'full' means wait: no
        room, or this step took what there was; 'ready': no room while the ready sets are full (no
        settle makes room then, only a batch formed or groups expired)."""
        await self.strays.sweep()  # (at most every half lease)
        backlog_limit, ready_limit = self.limits_used = await self.limits()
        room = await self._room(self.limits_used)
        state = None
        if self.settings.sync or (self.evals is not None and room.eval_due is not None):
            state = await self.store.state()  # (the barrier submits an eval's groups when it announces)
            if self.evals is not None and (due := self.evals.due(state)) is not None:
                await self.evals.submit(self.store, due)
                room = await self.store.room(backlog_limit, ready_limit)
        version = max((room.notice if state is None else state.notice) or 0, 0)
        if state is not None and self.settings.sync:
            if self._batch_formed(state, version):
                return "full", 0  # lockstep: this version's batch is formed; wait for the next version
            # About what the batch still needs: what is left over when it forms is stale.
            needed = max(1, self._groups_per_batch() - await self.store.fewest_ready(version))
            backlog_limit = min(backlog_limit, math.ceil(needed * self.feeder.sync_oversubmit))
            room = await self.store.room(backlog_limit, ready_limit)
        if room.groups <= 0:  # checked before encoding anything: a full backlog is the usual case
            return ("ready" if room.ready_full else "full"), 0
        cursor = room.cursor
        positions = range(cursor, cursor + STEP_POSITIONS)
        rows = [self.row_at(p) for p in positions]
        randoms = [_curation_draw(self.settings.seed, p) for p in positions]
        decisions = await self.curator.decide(rows, randoms, version)
        items, wanted = [], 0
        for p, row, submit in zip(positions, rows, decisions, strict=True):
            if submit and wanted == room.groups:
                break  # encoded only what there is room for (a settle frees a slot or two): later steps go on
            wanted += submit
            uid = self.uid_at(p)
            fields = encode(self._group(uid, row, version)) if submit else {}
            items.append(SubmitItem(submit, uid, row, version, fields))
        status, submitted, left = await self.store.submit(cursor, items, backlog_limit, ready_limit)
        self._left = ((backlog_limit, ready_limit), left)
        if left.groups > 0:
            self._hint = self._left  # (the next step, at once: no read)
        if submitted:
            log.debug("prompts_submitted", groups=submitted, cursor=cursor, version=version)
        if status == "moved" or (status == "ok" and left.groups > 0):
            return status, submitted  # ('ok': room left, or positions the curator skipped: again)
        return ("ready" if left.ready_full else "full"), submitted

    def _group(self, uid: str, row: int, version: int) -> PromptGroup:
        return PromptGroup(
            uid=uid,
            workflow=self.feeder.workflow,
            models=list(self.settings.models),
            n_samples=self.feeder.n_samples,
            version=version,
            sample=self.rows[row],
            submitted_at=time.time(),
        )


@functools.lru_cache(maxsize=4 * STEP_POSITIONS)
def _curation_draw(seed: int, position: int) -> float:
    """The curator's uniform draw for a dataset position (fixed per position; a position is considered
    by several steps until the cursor passes it): a hash, a quarter of what seeding a generator costs."""
    digest = hashlib.blake2b(b"%d:curate:%d" % (seed, position), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


async def _scan(redis, pattern: str) -> list[bytes]:
    return [k async for k in redis.scan_iter(match=pattern, count=SCAN_COUNT)]

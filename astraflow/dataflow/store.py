"""The dataflow's state in Redis and the atomic steps that change it (one Lua script each).

Nothing here is held in the process: every call reads or writes Redis, so any replica may take any
step and a replica killed between two calls leaves nothing half done.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from astraflow.dataflow.settings import DataflowSettings
from astraflow.messages import VersionPublished
from astraflow.streams import Bus
from astraflow.streams.connection import queue_script, register_scripts, with_script
from astraflow.streams.keys import GROUP_DATAFLOW, GROUP_RAAS, GROUP_TRAINER
from astraflow.streams.runstate import MAX_VERSION_STEP, RunState, read_state
from astraflow.streams.schema import Entry

SCRIPTS = ("submit", "submit_eval", "room", "collect", "form", "version", "announce")
INLINE_BYTES = 32 << 10
"""Accepted parts' bytes a settle passes to its script as arguments (one command); more go in by plain
HSETs in a MULTI with it, as Lua copies its arguments into its own heap (`tests/bench/settle_bytes.py`:
up to this size Redis spends 1.0-1.4x as much on the arguments, the dataflow half as much on one command;
at 256 KiB Redis spends twice as much)."""


@dataclass(frozen=True)
class SubmitItem:
    """One dataset position: submitted as `fields` (a PromptGroup entry) or skipped by the curator."""

    submit: bool
    uid: str
    row: int
    version: int
    fields: Mapping[str, bytes]


@dataclass(frozen=True)
class Room:
    """What the back-pressure limits admit now (a hint: `Store.submit` checks again, atomically)."""

    groups: int
    """Prompt groups that may be submitted."""
    ready_full: bool
    """No room because the ready sets are full (then a settle frees nothing: only a batch formed does)."""
    cursor: int
    notice: int | None
    """The state's dataset cursor and last version announced (None: none yet)."""
    eval_due: int | None = None
    """The last notice when it is of an eval version whose groups no one submitted (its barrier's replica
    died first): the feeder submits them."""


@dataclass(frozen=True)
class Part:
    """One model's share of a collected group: accepted (reason '') or dropped with a reason."""

    model: str
    reason: str
    min_version: int
    n_samples: int
    payload: bytes = b""


@dataclass(frozen=True)
class EvalRow:
    """One collected eval row: per policy its metrics, or why it was dropped (`reason`)."""

    version: int
    dataset: str
    scores: Mapping[str, Mapping[str, float]]
    reason: str = ""


@dataclass(frozen=True)
class Collected:
    """A decoded rollout entry and what the collector decided for it."""

    entry_id: str
    uid: str
    parts: Sequence[Part]
    rewards: Mapping[str, tuple[float, int]]
    """Per model, in the group's order: (mean reward, trajectories) of the trajectories that did not fail."""
    zero_variance: bool
    trace: Mapping[str, str]
    metrics: Mapping[str, Mapping[str, tuple[float, int]]] = field(default_factory=dict)
    """Per model and workflow metric: (sum, trajectories reporting it) over the trajectories that did not
    fail."""

    eval: EvalRow | None = None
    """An eval group's scores (it has no parts: nothing of it is ever trained on)."""

    @property
    def mean_reward(self) -> float | None:
        """The first model's mean reward (what the curators follow)."""
        return next((mean for mean, _ in self.rewards.values()), None)


@dataclass(frozen=True)
class Settled:
    """What a settle (`Store.collect`) did."""

    records_written: bool
    """The `metrics` entries went out with it (every item settled 'ok')."""
    replies: list[list[str]]
    """Per item: [status, outcome per part...] (collect.lua)."""
    room: Room | None = None
    """The feeder's room just after the settle, under the limits asked for (None: none asked)."""


class Store:
    def __init__(self, bus: Bus, settings: DataflowSettings, models: Sequence[str]) -> None:
        self.bus, self.settings, self.models = bus, settings, list(models)
        self.keys = bus.keys
        self._scripts = register_scripts(bus.redis, "astraflow.dataflow", SCRIPTS, prelude="common.lua")

    async def _run(self, name: str, keys: list[str], args: list):
        # Every script decides and acknowledges: with redis.min_replicas_ack, only once replicas have it.
        return await self.bus.hand_off_script(self._scripts[name], keys, args)

    # -- reads -------------------------------------------------------------------------------------

    async def state(self) -> RunState:
        return await read_state(self.bus)

    async def fewest_ready(self, version: int) -> int:
        """Groups in the smallest ready set of the run's models that `version` may still train on (in edf
        order the score is the deadline; in fifo order every group counts until the former expires it)."""
        fresh = version if self.settings.collector.order == "edf" else "-inf"

        async def counts():
            async with self.bus.redis.pipeline(transaction=False) as pipe:
                for m in self.models:
                    pipe.zcount(self.keys.ready(m), fresh, "+inf")
                return await pipe.execute()

        return min(await self.bus.call(counts))

    # -- steps -------------------------------------------------------------------------------------

    async def submit(
        self, cursor: int, items: Sequence[SubmitItem], backlog_limit: int, ready_limit: int
    ) -> tuple[str, int, Room]:
        """Submit/skip `items` from dataset position `cursor`; returns (status, submitted, the room left
        after it: its cursor the new one)."""
        k = self.keys
        keys = [k.prompts, k.state, k.in_flight, k.ledger, k.traces, *(k.ready(m) for m in self.models)]
        args: list = [cursor, GROUP_RAAS, backlog_limit, ready_limit, k.trace_prefix]
        args += [
            self.settings.trace_retention_s,
            f"{time.time():.3f}",
            len(items),
            self.settings.trace_max_groups,
            self.settings.batch.unit,
            self.settings.batch.size,
            self.settings.trace_every,
        ]
        for it in items:
            args += [int(it.submit), it.uid, it.row, it.version, len(it.fields)]
            for name, value in it.fields.items():
                args += [name, value]
        status, submitted, left = await self._run("submit", keys, args)
        return status.decode(), int(submitted), _room(left)

    async def submit_eval(
        self, version: int, groups: Sequence[Mapping[str, bytes]], rows: Mapping[str, int]
    ) -> int:
        """Submit the eval groups of `version` (PromptGroup entries) unless they were, with the `rows` of
        each dataset in the metrics stream; returns how many groups."""
        k = self.keys
        args: list = [version, f"{time.time():.3f}", len(groups), self.bus.settings.capped_maxlen, len(rows)]
        for name, n in rows.items():
            args += [name, n]
        for fields in groups:
            args += [fields[Entry.uid], len(fields)]
            for name, value in fields.items():
                args += [name, value]
        keys = [k.prompts, k.state, k.in_flight, k.ledger, k.metrics]
        return int(await self._run("submit_eval", keys, args))

    async def room(self, backlog_limit: int, ready_limit: int) -> Room:
        """What the feeder may submit now, and where (room.lua: one script, read only)."""
        keys = [self.keys.prompts, self.keys.state, *(self.keys.ready(m) for m in self.models)]
        args = [GROUP_RAAS, backlog_limit, ready_limit, self.settings.batch.unit, self.settings.batch.size]
        script = self._scripts["room"]  # (read only: no wait for replicas, unlike `_run`)
        return _room(await self.bus.call(lambda: script(keys=keys, args=args)))

    async def collect(
        self,
        consumer: str,
        items: Sequence[Collected],
        records: Sequence[Mapping[str, str]] = (),
        limits: tuple[int, int] | None = None,
    ) -> Settled:
        """Settle collected rollout entries (see collect.lua), adding the `metrics` entries `records` (their
        fields) when every item settles 'ok', and reading the feeder's room under `limits` (backlog and
        ready-set limits, as `room` takes them) after it: the settle is what frees room."""
        k, s = self.keys, self.settings
        keys = [k.rollouts, k.in_flight, k.ledger, k.state, k.curator("ewma"), k.curator("streak")]
        keys += [k.curator("greso"), k.errors, k.metrics, k.prompts]
        index = {}
        for m in self.models:
            index[m] = len(keys) + 1
            keys += [k.ready(m), k.samples(m), k.refs(m)]
        args: list = [GROUP_DATAFLOW, consumer, s.max_staleness_steps, k.trace_prefix, s.trace_retention_s]
        curator = "" if s.feeder.curator == "accept_all" else s.feeder.curator
        inline = sum(len(p.payload) for it in items for p in it.parts if not p.reason) <= INLINE_BYTES
        args += [s.collector.order, s.feeder.solved_alpha, f"{time.time():.3f}", curator, int(not inline)]
        args.append(len(items))
        for it in items:
            mean = "" if it.mean_reward is None else repr(it.mean_reward)
            args += [it.entry_id, it.uid, mean, int(it.zero_variance), len(it.trace)]
            for name, value in it.trace.items():
                args += [name, value]
            args.append(len(it.parts))
            for p in it.parts:
                bytes_ = p.payload if inline and not p.reason else b""
                args += [p.model, index[p.model], p.reason, p.min_version, p.n_samples, bytes_]
        args += [self.bus.settings.capped_maxlen, len(records)]
        for fields in records:
            args.append(len(fields))
            for name, value in fields.items():
                args += [name, value]
        args += [GROUP_RAAS, *(limits or ("", "")), s.batch.unit, s.batch.size]
        script = self._scripts["collect"]
        if inline:
            written, replies, room = await self.bus.call(lambda: script(keys=keys, args=args))
        else:
            written, replies, room = await self.bus.call(lambda: self._multi(script, items, keys, args))
        decoded = [[x.decode() for x in r] for r in replies]
        return Settled(bool(written), decoded, _room(room) if room else None)

    async def _multi(self, script, items: Sequence[Collected], keys: list, args: list):
        """The reply of `script` (collect.lua) run in one MULTI after plain HSETs of the accepted parts'
        bytes under their entries' ids (the script removes those of parts that end up held by nothing)."""
        by_model: dict[str, dict[str, bytes]] = {}
        for it in items:
            for p in it.parts:
                if not p.reason:
                    by_model.setdefault(p.model, {})[it.entry_id] = p.payload

        def fill(pipe) -> None:
            for model, payloads in by_model.items():  # one HSET per model, not per group
                pipe.hset(self.keys.samples(model), mapping=payloads)
            queue_script(pipe, script, keys, args)

        return (await with_script(self.bus.redis, script, fill, transaction=True))[-1]

    async def form(self, model: str, randoms: Sequence[float] = ()) -> tuple[str, str, int, int, int, int]:
        """Form at most one batch for `model`; returns (status, batch uid, fresh, replayed, expired,
        short): `short`, the batch units (samples or groups) missing for this batch ('wait') or for the
        next ('ok')."""
        k, s, b = self.keys, self.settings, self.settings.batch
        keys = [k.ready(model), k.samples(model), k.refs(model), k.replay(model), k.batches(model)]
        keys += [k.ledger, k.state, k.formed(model), k.identity]
        quota = round(b.replay_ratio * b.size)
        capacity = b.replay_capacity if b.replay_ratio > 0 else 0
        args: list = [model, s.max_staleness_steps, b.size, b.unit, quota, b.replay_selection, capacity]
        args += [b.prefetch, GROUP_TRAINER, k.trace_prefix, s.trace_retention_s, s.collector.order]
        args += [f"{time.time():.3f}", *(repr(r) for r in randoms)]
        status, uid, fresh, replayed, expired, short = await self._run("form", keys, args)
        return status.decode(), uid.decode(), int(fresh), int(replayed), int(expired), int(short)

    async def record_version(self, consumer: str, entry_id: str, msg: VersionPublished) -> str:
        """Record a published version with the XACK of its entry; returns 'ok', 'dup', 'lost', or 'far'
        (more than MAX_VERSION_STEP past the model's recorded version: nothing recorded nor acked)."""
        keys = [self.keys.versions, self.keys.state, self.keys.errors]
        args = [GROUP_DATAFLOW, consumer, entry_id, msg.model, msg.version, msg.manifest_key, int(msg.eval)]
        args += [msg.checkpoint, msg.incarnation, MAX_VERSION_STEP]
        return (await self._run("version", keys, args)).decode()

    async def announce(
        self, expected: int, version: int, fields: Mapping[str, bytes], forget: Sequence[str]
    ) -> tuple[str, int]:
        """Publish the notice of `version` if `expected` is still the last announced one."""
        g = self.settings.feeder.greso
        keys = [self.keys.notices, self.keys.state, self.keys.curator("greso")]
        args: list = [expected, version, self.bus.settings.capped_maxlen]
        args += [int(self.settings.feeder.curator == "greso"), g.p_init, g.step, g.floor]
        args += [g.target_easy, g.target_hard, len(forget), *forget]
        for name, value in fields.items():
            args += [name, value]
        status, last = await self._run("announce", keys, args)
        return status.decode(), int(last)


def _room(reply: list) -> Room:
    """A `room` reply of the scripts (common.lua)."""
    groups, ready_full, cursor, notice, eval_due = reply
    notice, eval_due = (None if v < 0 else int(v) for v in (notice, eval_due))
    return Room(int(groups), bool(ready_full), int(cursor), notice, eval_due)

"""The dataflow's state in Redis and the atomic steps that change it (one Lua script each).

Nothing here is held in the process: every call reads or writes Redis, so any replica may take any
step and a replica killed between two calls leaves nothing half done.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from astraflow.dataflow.curators import CURATORS, STREAK
from astraflow.dataflow.scripts import ANNOUNCE, COLLECT, FORM, ROOM, SUBMIT, SUBMIT_EVAL, VERSION
from astraflow.dataflow.settings import DataflowSettings
from astraflow.dataflow.steps import Collected, Room, Settled, SubmitItem
from astraflow.messages import VersionPublished
from astraflow.streams import Bus
from astraflow.streams.connection import queue_script, register_scripts, with_script
from astraflow.streams.contract import Contract
from astraflow.streams.keys import GROUP_DATAFLOW, GROUP_RAAS, GROUP_TRAINER
from astraflow.streams.runstate import MAX_VERSION_STEP, RunState, read_state
from astraflow.streams.schema import Entry

INLINE_BYTES = 32 << 10
"""Accepted parts' bytes a settle passes to its script as arguments (one command); more go in by plain
HSETs in a MULTI with it, as Lua copies its arguments into its own heap (`tests/bench/settle_bytes.py`:
up to this size Redis spends 1.0-1.4x as much on the arguments, the dataflow half as much on one command;
at 256 KiB Redis spends twice as much)."""


class Store:
    def __init__(self, bus: Bus, settings: DataflowSettings, models: Sequence[str]) -> None:
        self.bus, self.settings, self.models = bus, settings, list(models)
        self.keys = bus.keys
        names = tuple(c.name for c in (SUBMIT, SUBMIT_EVAL, ROOM, COLLECT, FORM, VERSION, ANNOUNCE))
        self._scripts = register_scripts(bus.redis, "astraflow.dataflow", names, prelude="common.lua")
        curator = CURATORS[settings.feeder.curator]
        self._curator = {
            "curator_state": self.keys.curator(curator.state or settings.feeder.curator),
            "curator": settings.feeder.curator,
            "streak": self.keys.curator(STREAK),
            "curator_params": curator.lua_params(settings.feeder),
        }
        """The curator's keys and arguments of collect.lua and announce.lua (`scripts.CURATOR_KEYS`)."""

    async def _run(self, contract: Contract, **values):
        """Run the script of `contract` with its keys and arguments by name."""
        # Every script decides and acknowledges: with redis.min_replicas_ack, only once replicas have it.
        keys, args = contract.call(**values)
        return await self.bus.hand_off_script(self._scripts[contract.name], keys, args)

    def _submit_keys(self) -> dict[str, str]:
        """The keys every submitting script takes (submit.lua, submit_eval.lua)."""
        k = self.keys
        return {"prompts": k.prompts, "state": k.state, "in_flight": k.in_flight, "ledger": k.ledger}

    def _room_args(self, backlog_limit: int | None, ready_limit: int | None) -> dict:
        """The arguments of the feeder's room (`scripts.ROOM_ARGS`)."""
        b = self.settings.batch
        return {
            "raas_group": GROUP_RAAS,
            "backlog_limit": backlog_limit,
            "ready_limit": ready_limit,
            "unit": b.unit,
            "batch_size": b.size,
        }

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
        k, s = self.keys, self.settings
        status, submitted, left = await self._run(
            SUBMIT,
            **self._submit_keys(),
            traces=k.traces,
            readys=[k.ready(m) for m in self.models],
            expected=cursor,
            **self._room_args(backlog_limit, ready_limit),
            trace_prefix=k.trace_prefix,
            trace_ttl_s=s.trace_retention_s,
            now=f"{time.time():.3f}",
            trace_max=s.trace_max_groups,
            trace_every=s.trace_every,
            items=[
                {f: getattr(it, f) for f in ("submit", "uid", "row", "version", "fields")} for it in items
            ],
        )
        return status.decode(), int(submitted), _room(left)

    async def submit_eval(
        self, version: int, groups: Sequence[Mapping[str, bytes]], rows: Mapping[str, int]
    ) -> int:
        """Submit the eval groups of `version` (PromptGroup entries) unless they were, with the `rows` of
        each dataset in the metrics stream; returns how many groups."""
        k = self.keys
        n = await self._run(
            SUBMIT_EVAL,
            **self._submit_keys(),
            metrics=k.metrics,
            version=version,
            now=f"{time.time():.3f}",
            metrics_maxlen=self.bus.settings.capped_maxlen,
            datasets=[{"name": name, "rows": n} for name, n in rows.items()],
            groups=[{"uid": fields[Entry.uid], "fields": fields} for fields in groups],
        )
        return int(n)

    async def room(self, backlog_limit: int, ready_limit: int) -> Room:
        """What the feeder may submit now, and where (room.lua: one script, read only)."""
        k = self.keys
        keys, args = ROOM.call(
            prompts=k.prompts,
            state=k.state,
            readys=[k.ready(m) for m in self.models],
            **self._room_args(backlog_limit, ready_limit),
        )
        script = self._scripts[ROOM.name]  # (read only: no wait for replicas, unlike `_run`)
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
        inline = sum(len(p.payload) for it in items for p in it.parts if not p.reason) <= INLINE_BYTES
        index = {m: i for i, m in enumerate(self.models, 1)}
        keys, args = COLLECT.call(
            rollouts=k.rollouts,
            in_flight=k.in_flight,
            ledger=k.ledger,
            state=k.state,
            errors=k.errors,
            metrics=k.metrics,
            prompts=k.prompts,
            models=[{"ready": k.ready(m), "samples": k.samples(m), "refs": k.refs(m)} for m in self.models],
            group=GROUP_DATAFLOW,
            consumer=consumer,
            max_staleness=s.max_staleness_steps,
            trace_prefix=k.trace_prefix,
            trace_ttl_s=s.trace_retention_s,
            order=s.collector.order,
            now=f"{time.time():.3f}",
            **self._curator,
            written=not inline,
            items=[_settle_item(it, index, inline) for it in items],
            metrics_maxlen=self.bus.settings.capped_maxlen,
            records=[{"fields": fields} for fields in records],
            **self._room_args(*(limits or (None, None))),
        )
        script = self._scripts[COLLECT.name]
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
        status, uid, fresh, replayed, expired, short = await self._run(
            FORM,
            ready=k.ready(model),
            samples=k.samples(model),
            refs=k.refs(model),
            replay=k.replay(model),
            batches=k.batches(model),
            ledger=k.ledger,
            state=k.state,
            formed=k.formed(model),
            identity=k.identity,
            model=model,
            max_staleness=s.max_staleness_steps,
            size=b.size,
            unit=b.unit,
            replay_quota=round(b.replay_ratio * b.size),
            selection=b.replay_selection,
            capacity=b.replay_capacity if b.replay_ratio > 0 else 0,
            prefetch=b.prefetch,
            trainer_group=GROUP_TRAINER,
            trace_prefix=k.trace_prefix,
            trace_ttl_s=s.trace_retention_s,
            order=s.collector.order,
            now=f"{time.time():.3f}",
            randoms=[repr(r) for r in randoms],
        )
        return status.decode(), uid.decode(), int(fresh), int(replayed), int(expired), int(short)

    async def record_version(self, consumer: str, entry_id: str, msg: VersionPublished) -> str:
        """Record a published version with the XACK of its entry; returns 'ok', 'dup', 'lost', or 'far'
        (more than MAX_VERSION_STEP past the model's recorded version: nothing recorded nor acked)."""
        k = self.keys
        status = await self._run(
            VERSION,
            versions=k.versions,
            state=k.state,
            errors=k.errors,
            group=GROUP_DATAFLOW,
            consumer=consumer,
            id=entry_id,
            model=msg.model,
            version=msg.version,
            manifest_key=msg.manifest_key,
            eval=msg.eval,
            checkpoint=msg.checkpoint,
            incarnation=msg.incarnation,
            max_step=MAX_VERSION_STEP,
        )
        return status.decode()

    async def announce(
        self, expected: int, version: int, fields: Mapping[str, bytes], forget: Sequence[str]
    ) -> tuple[str, int]:
        """Publish the notice of `version` if `expected` is still the last announced one."""
        status, last = await self._run(
            ANNOUNCE,
            notices=self.keys.notices,
            state=self.keys.state,
            **self._curator,
            expected=expected,
            version=version,
            maxlen=self.bus.settings.capped_maxlen,
            forget=forget,
            notice=fields,
        )
        return status.decode(), int(last)


def _settle_item(it: Collected, index: Mapping[str, int], inline: bool) -> dict:
    """One item of a collect.lua call (`scripts.COLLECT`): its parts' bytes passed when `inline`."""
    parts = [
        {
            "model": p.model,
            "index": index[p.model],
            "reason": p.reason,
            "min_version": p.min_version,
            "n_samples": p.n_samples,
            "payload": p.payload if inline and not p.reason else b"",
        }
        for p in it.parts
    ]
    mean = None if it.mean_reward is None else repr(it.mean_reward)
    return {
        "entry_id": it.entry_id,
        "uid": it.uid,
        "mean_reward": mean,
        "zero_var": it.zero_variance,
        "trace": it.trace,
        "parts": parts,
    }


def _room(reply: list) -> Room:
    """A `room` reply of the scripts (common.lua)."""
    groups, ready_full, cursor, notice, eval_due = reply
    notice, eval_due = (None if v < 0 else int(v) for v in (notice, eval_due))
    return Room(int(groups), bool(ready_full), int(cursor), notice, eval_due)

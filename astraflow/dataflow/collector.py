"""The collector: rollout groups in, per-model ready sets out, every outcome counted in the ledger."""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TypeVar

import structlog

from astraflow.columnar import column
from astraflow.dataflow.checks import Owned, check_groups, vocab_size
from astraflow.dataflow.completions import Completions
from astraflow.dataflow.evaluation import score
from astraflow.dataflow.steps import Collected, EvalRow, Room
from astraflow.dataflow.store import Store
from astraflow.dataflow.verdicts import Judge
from astraflow.errors import DecodeError, describe
from astraflow.messages import RolloutGroup, decode
from astraflow.streams import Consumer, Delivery
from astraflow.streams.connection import raise_if_cancelled
from astraflow.streams.keys import GROUP_DATAFLOW
from astraflow.streams.records import MAX_METRIC_NAMES, EvalResult, Record, RolloutStats, encode_record
from astraflow.streams.runstate import recorded_versions
from astraflow.streams.schema import Outcome, Trace

log = structlog.get_logger(__name__)
T = TypeVar("T")
UID = re.compile(r"[^\s]{1,200}")
NEWEST_TTL_S = 1.0
"""How long a read of the recorded trainer versions is reused: they bound a token's version only to within
`VERSIONS_AHEAD` of them, which a second-old read does as well as a fresh one (a round trip less a read)."""


class Collector:
    def __init__(
        self,
        store: Store,
        name: str,
        untrained: Collection[str] = (),
        eval_metrics: Sequence[str] = (),
        model_paths: Mapping[str, str] | None = None,
    ) -> None:
        """`untrained`: policies that serve but are not trained (`train: false`); their trajectories
        go into no batch. `eval_metrics`: what an eval row is scored by (`eval.metrics`). `model_paths`:
        each policy's starting weights; token ids are checked against the vocabulary of their
        `config.json` (read here, once) where there is one."""
        self.store, self.settings, self.untrained = store, store.settings.collector, frozenset(untrained)
        self.eval_metrics = list(eval_metrics)
        sizes = {m: vocab_size(p) for m, p in (model_paths or {}).items()}
        self.vocab = {m: n for m, n in sizes.items() if n is not None}
        self.consumer = Consumer(store.bus, store.keys.rollouts, GROUP_DATAFLOW, name)
        self.judge = Judge(self.settings, store.models)
        self.observe: Callable[[list[Record]], None] = lambda records: None
        """Sees the `metrics` entries once written (the replica's Prometheus series: `launch.build`)."""
        self.made_ready: Callable[[str, int], None] = lambda model, n_samples: None
        """Told of every group part put in a ready set: (model, samples) (the batch former's wake-ups)."""
        self._newest_read: tuple[float, dict[str, int]] = (-NEWEST_TTL_S, {})
        self.completions = Completions(store.bus)
        """The groups settled per worker: what the feeder counts a heartbeat for (`Feeder.counted`)."""

    async def step(self, block_ms: int | None) -> int:
        """Read up to `collector.read_count` rollout entries and settle them; returns entries read."""
        n, items = await self.prepare(block_ms)
        await self.commit(items)
        return n

    async def prepare(self, block_ms: int | None) -> tuple[int, list[Collected]]:
        """Read and judge the next entries (bad ones are dead-lettered); returns (entries read, decisions).
        The caller may prepare the next entries while the last decisions are being committed."""
        newest = await self._newest()  # first: a failure here leaves no entry read and unsettled
        await self.completions.flush()
        entries = await self.consumer.read(self.settings.read_count, block_ms)
        read = []
        for entry in entries:
            group = await self._handled(entry, functools.partial(self._decode, entry))
            if group is not None:
                read.append((entry, group))
        # The values of the whole read at once (no NaN or out-of-range value reaches a batch).
        rewards_in = self.settings.reward_range
        checks = check_groups([group for _, group in read], newest, self.vocab, rewards_in)
        items: list[Collected] = []
        for (entry, group), owned in zip(read, checks, strict=True):
            item = await self._handled(entry, functools.partial(self._decide, entry, group, owned))
            if item is not None:
                items.append(item)
        return len(entries), items

    async def commit(self, items: list[Collected], limits: tuple[int, int] | None = None) -> Room | None:
        """Settle decided entries in one atomic step, their `metrics` entries with them when all settle (a
        round trip less; otherwise those of the entries settled here are added after); returns the feeder's
        room after it under `limits` (`Store.collect`)."""
        if not items:
            return None
        ids = [it.entry_id for it in items]
        records = _records(items)
        try:
            done = await self.store.collect(self.consumer.name, items, _encoded(records), limits)
        except Exception as e:  # not settled: the next read takes them back (this replica may be alone)
            await self.consumer.give_back(ids, e)
            raise
        self.consumer.settled(ids)
        settled, debug = [], log.debug  # (one look-up a settle: each binds a logger, structlog's proxy)
        for item, (status, *outcomes) in zip(items, done.replies, strict=True):
            if status in ("lost", "unknown"):
                log.warning("rollout_not_settled", uid=item.uid, status=status)
                continue
            debug("rollout_collected", uid=item.uid, status=status, outcomes=outcomes)
            if status == "ok":
                settled.append(item)
                self.completions.seen(item.trace.get(Trace.raas, ""))
                for part, outcome in zip(item.parts, outcomes, strict=False):
                    if outcome == Outcome.ready:
                        self.made_ready(part.model, part.n_samples)
        if not done.records_written:
            records = _records(settled)
            await self._add_metrics(records)
        if records:
            self.observe(records)
        return done.room

    async def _add_metrics(self, records: list[Record]) -> None:
        if not records:
            return
        bus = self.store.bus

        async def add() -> None:  # one round trip for every model
            async with bus.redis.pipeline(transaction=False) as pipe:
                for fields in _encoded(records):
                    pipe.xadd(bus.keys.metrics, fields, maxlen=bus.settings.capped_maxlen, approximate=True)
                await pipe.execute()

        await bus.call(add)

    def _eval(self, entry_id: str, group: RolloutGroup) -> Collected:
        """An eval row: scored, never put into a ready set (no parts); dropped (counted, logged) when it
        failed or its tokens are not all of its eval version."""
        scores, reason = score(group, self.store.models, self.eval_metrics)
        if reason:
            log.warning("eval_row_dropped", uid=group.uid, version=group.eval_version, reason=reason)
        return Collected(
            entry_id=entry_id,
            uid=group.uid,
            parts=[],
            rewards={},
            zero_variance=False,
            trace={Trace.raas: group.raas, Trace.eval: Outcome.dropped(reason) if reason else Outcome.scored},
            eval=EvalRow(group.eval_version, group.eval_dataset, scores, reason),
        )

    async def _newest(self) -> dict[str, int]:
        """The trainer version recorded for each trained policy (0 before its first), read at most once
        per `NEWEST_TTL_S`."""
        at, newest = self._newest_read
        if time.monotonic() - at < NEWEST_TTL_S:
            return newest
        recorded = await recorded_versions(self.store.bus, self.store.models)
        newest = {m: recorded[m][0] if m in recorded else 0 for m in self.store.models}
        self._newest_read = (time.monotonic(), newest)
        return newest

    async def _handled(self, entry: Delivery, step: Callable[[], T]) -> T | None:
        """`step()` for `entry`, or None when it raised: a DecodeError (InvalidRollout too: its values are
        bad) dead-letters the entry, any other error (a user filter raised) releases it (retried, dead
        after `max_deliveries`); when that fails too, the next read takes it back."""
        try:
            try:
                return step()
            except DecodeError as e:
                log.error("rollout_dead_lettered", id=entry.id, error=str(e))
                await self.consumer.dead_letter(entry, f"{type(e).__name__}: {e}")
            except Exception as e:
                log.warning("rollout_failed", id=entry.id, error=describe(e))
                await self.consumer.release(entry, f"{type(e).__name__}: {e}")
        except Exception as e:
            raise_if_cancelled()
            log.error("rollout_unsettled", id=entry.id, error=describe(e))
            await self.consumer.give_back([entry.id], e)
        return None

    def _decode(self, entry: Delivery) -> RolloutGroup:
        group = decode(entry.fields, RolloutGroup, self.store.bus.settings.max_entry_bytes)
        if not UID.fullmatch(group.uid):
            raise DecodeError(f"uid: {group.uid[:40]!r} is not 1-200 non-space characters")
        unknown = set(column(group.trajectories, "model")) - set(self.store.models) - self.untrained
        if unknown:
            raise DecodeError(f"trajectories.model: {sorted(unknown)} not trained in this run")
        return group

    def _decide(self, entry: Delivery, group: RolloutGroup, owned: Owned | Exception) -> Collected:
        """The decision for `group`, whose values `check_groups` found to be `owned` (or raised)."""
        if isinstance(owned, Exception):
            raise owned
        if group.eval_version >= 0:
            return self._eval(entry.id, group)
        return self.judge(entry.id, group, entry.fields["data"], owned)


def _encoded(records: list[Record]) -> list[dict[str, str]]:
    return [encode_record(r) for r in records]


def _records(items: list[Collected]) -> list[Record]:
    """The `metrics` entries of settled `items`: per model the on-policy reward of what was collected
    (before any filter) and the sums of the workflow's metrics (`kind=rollouts`); per eval version,
    dataset and policy the sums of the eval metrics over the rows scored (`kind=eval`; readers add up the
    entries of a version)."""
    totals: dict[str, tuple[float, int, int]] = {}
    metrics: dict[str, dict[str, list[float]]] = {}
    evals: dict[tuple[int, str, str], tuple[int, dict[str, float]]] = {}
    for it in items:
        for model, (mean, n) in it.rewards.items():
            reward_sum, samples, groups = totals.get(model, (0.0, 0, 0))
            totals[model] = (reward_sum + mean * n, samples + n, groups + 1)
        for model, sums in it.metrics.items():
            mine = metrics.setdefault(model, {})
            for name, (total, n) in sums.items():
                if name not in mine and len(mine) >= MAX_METRIC_NAMES:
                    continue  # (each group's are checked; their union is capped too)
                acc = mine.setdefault(name, [0.0, 0])
                acc[0], acc[1] = acc[0] + total, acc[1] + n
        if it.eval is None or it.eval.reason:
            continue
        for model, values in it.eval.scores.items():
            key = (it.eval.version, it.eval.dataset, model)
            rows, acc = evals.get(key, (0, {}))
            for name, value in values.items():
                acc[name] = acc.get(name, 0.0) + value
            evals[key] = (rows + 1, acc)
    now = time.time()
    out: list[Record] = [RolloutStats(m, g, n, r, now, metrics.get(m, {})) for m, (r, n, g) in totals.items()]
    return out + [EvalResult(m, d, v, n, acc, now) for (v, d, m), (n, acc) in evals.items()]

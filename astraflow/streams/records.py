"""Typed records of the `metrics` stream and of dead letters: one encoder and one decoder for each.

A record travels as flat plain fields (a person reads it with redis-cli as it is); `kind` says which
record it is; the field names are the schema's (`streams.schema.MetricEntry`, `DeadLetter`). Writers:
the trainer (`TrainerStep`), the collector (`RolloutStats`, `EvalResult`: encoded here, added by its
settle's collect.lua), submit_eval.lua (`EvalSubmitted`, names from the generated prelude), the bus and
the scripts that dead-letter (`DeadLetterRecord`). Readers: the launcher's progress and evals, `astraflow
scale`, tracking, the Prometheus endpoint, `astraflow trace` and `peek`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from astraflow.errors import DecodeError
from astraflow.streams.schema import DeadLetter, Entry, MetricEntry

METRIC_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.:/-]{0,63}")
"""What a workflow metric's name must be: printable, short, the same in TensorBoard, metrics.jsonl and
the status line. The collector refuses a rollout with another (`dataflow.checks`), and the readers of
the `metrics` stream skip one (`tracking.feed`)."""
MAX_METRIC_NAMES = 32
"""Most workflow metrics a trajectory may report, and a step of one policy logs (the first seen)."""


@dataclass(frozen=True)
class TrainerStep:
    # trainer -> metrics, after each step
    KIND: ClassVar[str] = "trainer"
    model: str
    version: int
    """The version the step produced."""
    batch: str
    """The uid of the batch it trained on."""
    time: float
    stats: dict[str, float]
    """The step's statistics (loss, reward_mean, samples, step_s, ...)."""


@dataclass(frozen=True)
class RolloutStats:
    # collector -> metrics: what one collect step took in for a model, before any filter
    KIND: ClassVar[str] = "rollouts"
    model: str
    groups: int
    samples: int
    reward_sum: float
    time: float
    metrics: dict[str, list[float]] = field(default_factory=dict)
    """The workflow's metrics: name -> [sum, trajectories]."""


@dataclass(frozen=True)
class EvalResult:
    # collector -> metrics: rows of one eval (policy, dataset, version) scored in one collect step
    KIND: ClassVar[str] = "eval"
    model: str
    dataset: str
    version: int
    rows: int
    sums: dict[str, float]
    """Metric -> sum over the rows (readers add up a version's records)."""
    time: float


@dataclass(frozen=True)
class EvalSubmitted:
    # submit_eval.lua -> metrics: how many rows an eval dataset has at a version
    KIND: ClassVar[str] = MetricEntry.kind_eval_submitted
    version: int
    dataset: str
    rows: int
    time: float


@dataclass(frozen=True)
class DeadLetterRecord:
    # anyone -> `dead`: an entry set aside, where it came from and why
    KIND: ClassVar[str] = DeadLetter.kind
    source: str
    """The stream (or set) it came from."""
    reason: str
    source_id: str = ""
    group: str = ""
    consumer: str = ""
    deliveries: int | None = None
    fields: dict[str, Any] = field(default_factory=dict)
    """The original entry's fields (larger values replaced by their size and digest)."""
    settled: str = ""
    """The prompt group it settled as dead: the uid the entry's `data` names ('' when none). What a
    group's trace goes by; the copied plain `uid` field is for people."""

    @property
    def uid(self) -> str | None:
        """The plain `uid` field of the original entry, as its writer put it (None: it had none)."""
        value = self.fields.get(Entry.uid)
        return value.decode(errors="replace") if isinstance(value, bytes) else value


Record = TrainerStep | RolloutStats | EvalResult | EvalSubmitted | DeadLetterRecord


def encode_record(r: Record) -> dict[str, Any]:
    """The entry's fields (str values; a dead letter's copied fields as they were)."""
    if isinstance(r, TrainerStep):
        out = {
            Entry.model: r.model,
            Entry.version: str(r.version),
            MetricEntry.batch: r.batch,
            MetricEntry.data: json.dumps(r.stats),
        }
    elif isinstance(r, RolloutStats):
        out = {Entry.model: r.model, MetricEntry.groups: str(r.groups), MetricEntry.samples: str(r.samples)}
        out[MetricEntry.reward_sum] = repr(r.reward_sum)
        out |= {MetricEntry.metrics: json.dumps(r.metrics)} if r.metrics else {}
    elif isinstance(r, EvalResult):
        out = {
            Entry.model: r.model,
            MetricEntry.dataset: r.dataset,
            Entry.version: str(r.version),
            MetricEntry.rows: str(r.rows),
        }
        out[MetricEntry.sums] = json.dumps(r.sums)
    elif isinstance(r, EvalSubmitted):
        out = {Entry.version: str(r.version), MetricEntry.dataset: r.dataset, MetricEntry.rows: str(r.rows)}
    else:
        out = {
            DeadLetter.source: r.source,
            DeadLetter.source_id: r.source_id,
            DeadLetter.group: r.group,
            DeadLetter.consumer: r.consumer,
        }
        out |= {DeadLetter.deliveries: str(r.deliveries)} if r.deliveries is not None else {}
        out[DeadLetter.reason] = r.reason
        out |= {DeadLetter.settled: r.settled} if r.settled else {}
        return {Entry.kind: r.KIND, **out, **{DeadLetter.copied(k): v for k, v in r.fields.items()}}
    return {Entry.kind: r.KIND, **out, MetricEntry.time: f"{r.time:.3f}"}


def decode_record(raw: Mapping[Any, Any]) -> Record | None:
    """The record an entry holds (None: not a record's kind); DecodeError names a bad field."""
    f = {_text(k): v for k, v in raw.items()}
    kind = _text(f.get(Entry.kind, b""))
    try:
        if kind == DeadLetter.kind:
            copied = {
                k.removeprefix(DeadLetter.copied("")): v
                for k, v in f.items()
                if k.startswith(DeadLetter.copied(""))
            }
            deliveries = f.get(DeadLetter.deliveries)
            return DeadLetterRecord(
                source=_text(f[DeadLetter.source]),
                reason=_text(f.get(DeadLetter.reason, b"")),
                source_id=_text(f.get(DeadLetter.source_id, b"")),
                group=_text(f.get(DeadLetter.group, b"")),
                consumer=_text(f.get(DeadLetter.consumer, b"")),
                deliveries=None if deliveries is None else int(deliveries),
                fields=copied,
                settled=_text(f.get(DeadLetter.settled, b"")),
            )
        t = {k: _text(v) for k, v in f.items()}
        if kind == TrainerStep.KIND:
            stats = json.loads(t[MetricEntry.data])
            return TrainerStep(
                t[Entry.model], int(t[Entry.version]), t[MetricEntry.batch], float(t[MetricEntry.time]), stats
            )
        if kind == RolloutStats.KIND:
            metrics = json.loads(t.get(MetricEntry.metrics, "{}"))
            groups, samples, reward_sum = (
                int(t[MetricEntry.groups]),
                int(t[MetricEntry.samples]),
                float(t[MetricEntry.reward_sum]),
            )
            return RolloutStats(
                t[Entry.model], groups, samples, reward_sum, float(t[MetricEntry.time]), metrics
            )
        if kind == EvalResult.KIND:
            version, rows, sums = (
                int(t[Entry.version]),
                int(t[MetricEntry.rows]),
                json.loads(t[MetricEntry.sums]),
            )
            return EvalResult(
                t[Entry.model], t[MetricEntry.dataset], version, rows, sums, float(t[MetricEntry.time])
            )
        if kind == EvalSubmitted.KIND:
            return EvalSubmitted(
                int(t[Entry.version]),
                t[MetricEntry.dataset],
                int(t[MetricEntry.rows]),
                float(t[MetricEntry.time]),
            )
    except KeyError as e:
        raise DecodeError(f"{kind} record: missing field {e.args[0]!r}") from None
    except ValueError as e:
        raise DecodeError(f"{kind} record: {e}") from None
    return None


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return value.decode()
    except UnicodeDecodeError:
        raise DecodeError("not UTF-8") from None


def add_metrics(into: dict[str, list[float]], metrics: dict[str, list[float]]) -> None:
    """Add a collect step's workflow metrics (name -> [sum, trajectories]) to a step's: only names of
    METRIC_NAME, and at most MAX_METRIC_NAMES a step (the first seen). The collector refuses a rollout
    with others; the readers of `metrics` (the tracking feed, the launcher's progress) add through this,
    which keeps an entry someone else wrote out of the status line, TensorBoard and metrics.jsonl too."""
    for name, (total, n) in metrics.items():
        if name not in into and (len(into) >= MAX_METRIC_NAMES or not METRIC_NAME.fullmatch(name)):
            continue
        acc = into.setdefault(name, [0.0, 0])
        acc[0], acc[1] = acc[0] + total, acc[1] + n

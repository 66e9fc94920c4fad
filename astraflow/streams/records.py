"""Typed records of the `metrics` stream and of dead letters: one encoder and one decoder for each.

A record travels as flat plain fields (a person reads it with redis-cli as it is); `kind` says which
record it is; the field names are the schema's (`streams.schema.MetricEntry`, `DeadLetter`). Writers:
the trainer (`TrainerStep`), the collector (`RolloutStats`, `EvalResult`: encoded here, added by its
settle's collect.lua), submit_eval.lua (`EvalSubmitted`, names from the generated prelude), the bus and
the scripts that dead-letter (`DeadLetter`). Readers: the launcher's progress and evals, `astraflow
scale`, tracking, the Prometheus endpoint, `astraflow trace` and `peek`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from astraflow.errors import DecodeError
from astraflow.streams.schema import DeadLetter as D
from astraflow.streams.schema import Entry as E
from astraflow.streams.schema import MetricEntry as M

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
    KIND: ClassVar[str] = M.kind_eval_submitted
    version: int
    dataset: str
    rows: int
    time: float


@dataclass(frozen=True)
class DeadLetter:
    # anyone -> `dead`: an entry set aside, where it came from and why
    KIND: ClassVar[str] = D.kind
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
        value = self.fields.get(E.uid)
        return value.decode(errors="replace") if isinstance(value, bytes) else value


Record = TrainerStep | RolloutStats | EvalResult | EvalSubmitted | DeadLetter


def encode_record(r: Record) -> dict[str, Any]:
    """The entry's fields (str values; a dead letter's copied fields as they were)."""
    if isinstance(r, TrainerStep):
        out = {E.model: r.model, E.version: str(r.version), M.batch: r.batch, M.data: json.dumps(r.stats)}
    elif isinstance(r, RolloutStats):
        out = {E.model: r.model, M.groups: str(r.groups), M.samples: str(r.samples)}
        out[M.reward_sum] = repr(r.reward_sum)
        out |= {M.metrics: json.dumps(r.metrics)} if r.metrics else {}
    elif isinstance(r, EvalResult):
        out = {E.model: r.model, M.dataset: r.dataset, E.version: str(r.version), M.rows: str(r.rows)}
        out[M.sums] = json.dumps(r.sums)
    elif isinstance(r, EvalSubmitted):
        out = {E.version: str(r.version), M.dataset: r.dataset, M.rows: str(r.rows)}
    else:
        out = {D.source: r.source, D.source_id: r.source_id, D.group: r.group, D.consumer: r.consumer}
        out |= {D.deliveries: str(r.deliveries)} if r.deliveries is not None else {}
        out[D.reason] = r.reason
        out |= {D.settled: r.settled} if r.settled else {}
        return {E.kind: r.KIND, **out, **{D.copied(k): v for k, v in r.fields.items()}}
    return {E.kind: r.KIND, **out, M.time: f"{r.time:.3f}"}


def decode_record(raw: Mapping[Any, Any]) -> Record | None:
    """The record an entry holds (None: not a record's kind); DecodeError names a bad field."""
    f = {_text(k): v for k, v in raw.items()}
    kind = _text(f.get(E.kind, b""))
    try:
        if kind == D.kind:
            copied = {k.removeprefix(D.copied("")): v for k, v in f.items() if k.startswith(D.copied(""))}
            deliveries = f.get(D.deliveries)
            return DeadLetter(
                source=_text(f[D.source]),
                reason=_text(f.get(D.reason, b"")),
                source_id=_text(f.get(D.source_id, b"")),
                group=_text(f.get(D.group, b"")),
                consumer=_text(f.get(D.consumer, b"")),
                deliveries=None if deliveries is None else int(deliveries),
                fields=copied,
                settled=_text(f.get(D.settled, b"")),
            )
        t = {k: _text(v) for k, v in f.items()}
        if kind == TrainerStep.KIND:
            stats = json.loads(t[M.data])
            return TrainerStep(t[E.model], int(t[E.version]), t[M.batch], float(t[M.time]), stats)
        if kind == RolloutStats.KIND:
            metrics = json.loads(t.get(M.metrics, "{}"))
            groups, samples, reward_sum = int(t[M.groups]), int(t[M.samples]), float(t[M.reward_sum])
            return RolloutStats(t[E.model], groups, samples, reward_sum, float(t[M.time]), metrics)
        if kind == EvalResult.KIND:
            version, rows, sums = int(t[E.version]), int(t[M.rows]), json.loads(t[M.sums])
            return EvalResult(t[E.model], t[M.dataset], version, rows, sums, float(t[M.time]))
        if kind == EvalSubmitted.KIND:
            return EvalSubmitted(int(t[E.version]), t[M.dataset], int(t[M.rows]), float(t[M.time]))
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

"""`astraflow ledger` (the run's counters, and whether they balance: `dataflow.ledger`) and `astraflow
trace` (the path of one prompt group through the run, dead letters included)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from datetime import UTC, datetime

from astraflow.config import Settings
from astraflow.dataflow.ledger import read_ledger
from astraflow.ops.context import settings_from, with_bus
from astraflow.streams import Bus
from astraflow.streams.records import DeadLetterRecord, decode_record
from astraflow.streams.schema import Outcome, Trace


def cmd_ledger(args) -> int:
    settings = settings_from(args)
    return asyncio.run(with_bus(settings, lambda bus: _ledger(bus, settings, args.json), known=True))


async def _ledger(bus: Bus, settings: Settings, as_json: bool) -> int:
    ledger = await read_ledger(bus, settings.trained)
    print(json.dumps(ledger.as_dict(), indent=2) if as_json else ledger.render())
    return 1 if ledger.problems() else 0


def cmd_trace(args) -> int:
    settings = settings_from(args)
    return asyncio.run(with_bus(settings, lambda bus: _trace(bus, settings, args.uid), known=True))


async def _trace(bus: Bus, settings: Settings, uid: str) -> int:
    trace = await read_trace(bus, uid)
    if trace is None:
        every = settings.dataflow.trace_every
        kept = "no group is traced" if every == 0 else f"one group in {every} is traced"
        print(f"no trace of prompt group {uid!r} in run {settings.run.name!r} ({kept}; unknown, or expired)")
        return 1
    print(render_trace(uid, trace, settings.trained))
    return 0


DEAD_SCAN = 10_000
"""Newest dead letters searched for a traced group."""


async def read_trace(bus: Bus, uid: str) -> dict[str, str] | None:
    """The lineage of prompt group `uid` (None when unknown or past the retention), dead letters included."""
    raw = await bus.redis.hgetall(bus.keys.trace(uid))
    trace = {k.decode(): v.decode(errors="replace") for k, v in raw.items()}
    for _, fields in await bus.redis.xrevrange(bus.keys.dead, count=DEAD_SCAN):
        letter = decode_record(fields)
        if (
            isinstance(letter, DeadLetterRecord) and letter.settled == uid
        ):  # (not its plain `uid`: see DeadLetter)
            trace.setdefault(Trace.dead, f"{bus.keys.short(letter.source)}: {letter.reason}")
    return trace or None


def render_trace(uid: str, trace: dict[str, str], models: Sequence[str]) -> str:
    def when(field_name: str) -> str:
        at = trace.get(field_name)
        return datetime.fromtimestamp(float(at), UTC).strftime(" at %H:%M:%S.%f")[:-3] + " UTC" if at else ""

    lines = [f"prompt group {uid}"]
    if Trace.row in trace:
        lines.append(
            f"  submitted  at version {trace.get(Trace.submitted_version)}, dataset row {trace[Trace.row]}"
            + when(Trace.submitted_at)
        )
    if Trace.raas in trace:
        lines.append(
            f"  rolled out by {trace[Trace.raas]}, token versions {trace.get(Trace.token_versions, 'none')}"
            + when(Trace.collected_at)
        )
    if Trace.error in trace:
        lines.append(f"  error      {trace[Trace.error]}")
    for m in models:
        if Trace.outcome(m) not in trace:
            continue
        outcome = trace[Trace.outcome(m)]
        if outcome == Outcome.trained:
            outcome = (
                f"trained in batch {trace.get(Trace.batch(m))} (formed at trainer version "
                f"{trace.get(Trace.batch_version(m))}, trained by the step to the next version)"
                + when(Trace.batched_at(m))
            )
        elif outcome == Outcome.ready:
            outcome = f"ready, min token version {trace.get(Trace.min_version(m))}, waiting for a batch"
        lines.append(f"  {m}: {outcome}")
    if Trace.dead in trace:
        lines.append(f"  dead-lettered from {trace[Trace.dead]}")
    if Trace.raas not in trace and Trace.dead not in trace and Trace.row in trace:
        lines.append("  in flight (not collected yet)")
    return "\n".join(lines)

"""`astraflow peek STREAM`: a run's stream entries (or a hash: a heartbeat, a manifest) decoded to JSON.

A message is decoded from its msgpack `data` alone - the plain fields beside it are for people and never
trusted; a batch with its groups, fetched from the samples hash by its `refs`; a dead letter with the
original entry it holds, when that still decodes; a metrics entry is its plain fields (JSON values parsed).

Whatever an entry holds, peek's memory and output stay bounded (a worker may write `dead`): an entry over
`max_bytes` is shown as its fields' sizes, undecoded; dead letters nested in dead letters are followed
MAX_LETTERS deep, values MAX_DEPTH deep, lists to their first MAX_ITEMS items and an entry to MAX_VALUES
values; what is cut says so where it was cut.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
from typing import Any

import numpy as np

from astraflow.columnar import ColumnList
from astraflow.dataflow.batches import fetch_batch
from astraflow.errors import DecodeError
from astraflow.messages import KINDS, SampleGroup, decode
from astraflow.ops.context import settings_from, with_bus
from astraflow.streams.bus import Bus
from astraflow.streams.records import decode_record
from astraflow.streams.schema import BatchEntry, DeadLetter, Entry, MetricEntry

ARRAY_ITEMS = 32
"""Longer arrays show their dtype, shape and first items only."""
JSON_FIELDS = (MetricEntry.data, MetricEntry.sums, MetricEntry.metrics)
MAX_BYTES = 16 << 20
"""An entry (or hash) larger than this, names and values together, is not decoded (`--max-bytes`)."""
MAX_LETTERS = 4
"""Dead letters followed into the dead letters they hold."""
MAX_DEPTH = 32
"""Nesting shown of a value (a message's lists and maps, a JSON field)."""
MAX_ITEMS = 256
"""Items shown of a list or map."""
MAX_VALUES = 20_000
"""Values shown of one entry, all fields together."""
SHOWN_FIELDS = 32
"""Fields named (with their sizes) of an entry too large to decode."""


async def peek(
    bus: Bus, name: str, count: int = 1, entry_id: str | None = None, max_bytes: int = MAX_BYTES
) -> list[dict[str, Any]]:
    """The newest `count` entries of the run's key `name` (oldest first), or entry `entry_id`, decoded
    within the limits above; a hash key gives one item (its fields). Raises KeyError for a key the run
    does not have."""
    key = name if name.startswith(bus.keys.prefix) else bus.keys.prefix + name
    kind = (await bus.call(lambda: bus.redis.type(key))).decode()
    if kind == "hash":
        return [{"key": bus.keys.short(key), **await describe(bus, await bus.redis.hgetall(key), max_bytes)}]
    if kind != "stream":
        raise KeyError(f"{bus.keys.short(key)!r} is not a stream or hash of run {bus.keys.run!r} ({kind})")
    if entry_id is not None:
        entries = await bus.redis.xrange(key, entry_id, entry_id)
    else:
        entries = list(reversed(await bus.redis.xrevrange(key, count=count)))
    return [{"id": i.decode(), **await describe(bus, fields, max_bytes)} for i, fields in entries]


async def describe(bus: Bus | None, raw: dict, max_bytes: int = MAX_BYTES) -> dict[str, Any]:
    """One entry (or hash) as JSON-ready values; `bus` fetches a batch's groups (None: not fetched).
    One over `max_bytes` is shown as its fields' names and sizes."""
    size = sum(len(k) + len(v) for k, v in raw.items())
    if size > max_bytes:
        shown = {_text(k)[:64]: f"<{len(v)} bytes>" for k, v in itertools.islice(raw.items(), SHOWN_FIELDS)}
        return {
            "error": f"{size} bytes, over peek's limit of {max_bytes}: not decoded (--max-bytes to raise it)",
            "fields": shown,
        }
    return await _describe(bus, raw, _Budget(), MAX_LETTERS)


async def _describe(bus: Bus | None, raw: dict, budget: _Budget, letters: int) -> dict[str, Any]:
    fields = {_text(k): v for k, v in raw.items()}
    kind = _text(fields.get(Entry.kind, b""))
    try:
        if kind in KINDS:
            return {"kind": kind, "message": budget.json(decode(fields))}
        if kind == BatchEntry.kind and bus is not None:
            return {"kind": kind, "message": budget.json(await fetch_batch(bus, fields))}
        if kind == DeadLetter.kind:
            prefix = DeadLetter.copied("")
            plain = _plain({k: v for k, v in fields.items() if not k.startswith(prefix)}, budget)
            if letters == 0:
                return {**plain, "entry": {"error": f"a dead letter nested over {MAX_LETTERS} deep: cut"}}
            letter = decode_record(fields)  # the original entry's fields, as it held them
            return {**plain, "entry": await _describe(None, letter.fields, budget, letters - 1)}
    except DecodeError as e:
        return {"kind": kind, "error": f"DecodeError: {e}", "fields": _plain(fields, budget)}
    return _plain(fields, budget)


def to_json(value: Any) -> Any:
    """`value` (a message, its parts, JSON values) as JSON-ready values, within the limits above."""
    return _Budget().json(value)


class _Budget:
    """What is left to show of one entry: MAX_VALUES values, each at most MAX_DEPTH deep."""

    def __init__(self) -> None:
        self.left = MAX_VALUES

    def json(self, value: Any, depth: int = 0) -> Any:
        if self.left <= 0:
            return f"<cut: over {MAX_VALUES} values>"
        if depth >= MAX_DEPTH:
            return f"<cut: nested over {MAX_DEPTH} deep>"
        self.left -= 1
        below = depth + 1
        if isinstance(value, SampleGroup):
            names = [f.name for f in dataclasses.fields(value) if f.name != "rollout"]  # (bytes: below)
            plain = {name: self.json(getattr(value, name), below) for name in names}
            return plain | {"trajectories": self.json(value.trajectories, below)}
        if dataclasses.is_dataclass(value):
            return {f.name: self.json(getattr(value, f.name), below) for f in dataclasses.fields(value)}
        if isinstance(value, np.ndarray):
            if value.size <= ARRAY_ITEMS:
                return value.tolist()
            first = value.reshape(-1)[:ARRAY_ITEMS].tolist()
            return {"dtype": str(value.dtype), "shape": list(value.shape), "first": first}
        if isinstance(value, list | tuple | ColumnList):
            shown = [self.json(v, below) for v in itertools.islice(value, MAX_ITEMS)]
            return shown + ([f"<cut: {len(value) - MAX_ITEMS} more>"] if len(value) > MAX_ITEMS else [])
        if isinstance(value, dict):
            shown = {str(k): self.json(v, below) for k, v in itertools.islice(value.items(), MAX_ITEMS)}
            return shown | ({"<cut>": f"{len(value) - MAX_ITEMS} more"} if len(value) > MAX_ITEMS else {})
        if isinstance(value, bytes):
            return f"<{len(value)} bytes>"
        return value


def _plain(fields: dict[str, Any], budget: _Budget) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in fields.items():
        out[name] = _text(value)
        if name in JSON_FIELDS:
            try:
                out[name] = budget.json(json.loads(out[name]))
            except (ValueError, RecursionError):  # (nested deeper than the parser goes: kept as text)
                pass
    return out


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return value.decode()
    except UnicodeDecodeError:
        return f"<{len(value)} bytes>"


def cmd_peek(args) -> int:
    settings = settings_from(args)

    async def show(bus: Bus) -> int:
        try:
            items = await peek(bus, args.stream, args.count, args.id, args.max_bytes or MAX_BYTES)
        except KeyError as e:
            print(e.args[0])
            return 1
        for item in items:
            print(json.dumps(item, indent=2))
        return 0

    return asyncio.run(with_bus(settings, show, known=True))

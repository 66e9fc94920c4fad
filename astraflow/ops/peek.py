"""`astraflow peek STREAM`: a run's stream entries (or a hash: a heartbeat, a manifest) decoded to JSON.

A message is decoded from its msgpack `data` alone - the plain fields beside it are for people and never
trusted; a batch with its groups, fetched from the samples hash by its `refs`; a dead letter with the
original entry it holds, when that still decodes; a metrics entry is its plain fields (JSON values parsed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import numpy as np

from astraflow.dataflow.batches import fetch_batch
from astraflow.decoding import ColumnList
from astraflow.errors import DecodeError
from astraflow.messages import KINDS, SampleGroup, decode
from astraflow.ops.context import settings_from, with_bus
from astraflow.streams.bus import Bus
from astraflow.streams.records import decode_record
from astraflow.streams.schema import BatchEntry, DeadLetter, Entry, MetricEntry

ARRAY_ITEMS = 32
"""Longer arrays show their dtype, shape and first items only."""
JSON_FIELDS = (MetricEntry.data, MetricEntry.sums, MetricEntry.metrics)


async def peek(bus: Bus, name: str, count: int = 1, entry_id: str | None = None) -> list[dict[str, Any]]:
    """The newest `count` entries of the run's key `name` (oldest first), or entry `entry_id`, decoded;
    a hash key gives one item (its fields). Raises KeyError for a key the run does not have."""
    key = name if name.startswith(bus.keys.prefix) else bus.keys.prefix + name
    kind = (await bus.call(lambda: bus.redis.type(key))).decode()
    if kind == "hash":
        return [{"key": bus.keys.short(key), **await describe(bus, await bus.redis.hgetall(key))}]
    if kind != "stream":
        raise KeyError(f"{bus.keys.short(key)!r} is not a stream or hash of run {bus.keys.run!r} ({kind})")
    if entry_id is not None:
        entries = await bus.redis.xrange(key, entry_id, entry_id)
    else:
        entries = list(reversed(await bus.redis.xrevrange(key, count=count)))
    return [{"id": i.decode(), **await describe(bus, fields)} for i, fields in entries]


async def describe(bus: Bus | None, raw: dict) -> dict[str, Any]:
    """One entry (or hash) as JSON-ready values; `bus` fetches a batch's groups (None: not fetched)."""
    fields = {_text(k): v for k, v in raw.items()}
    kind = _text(fields.get(Entry.kind, b""))
    try:
        if kind in KINDS:
            return {"kind": kind, "message": to_json(decode(fields))}
        if kind == BatchEntry.kind and bus is not None:
            return {"kind": kind, "message": to_json(await fetch_batch(bus, fields))}
        if kind == DeadLetter.kind:
            letter = decode_record(fields)  # the original entry's fields, as it held them
            prefix = DeadLetter.copied("")
            plain = _plain({k: v for k, v in fields.items() if not k.startswith(prefix)})
            return {**plain, "entry": await describe(None, letter.fields)}
    except DecodeError as e:
        return {"kind": kind, "error": f"DecodeError: {e}", "fields": _plain(fields)}
    return _plain(fields)


def to_json(value: Any) -> Any:
    if isinstance(value, SampleGroup):
        names = [f.name for f in dataclasses.fields(value) if f.name != "rollout"]  # (bytes: decoded below)
        plain = {name: to_json(getattr(value, name)) for name in names}
        return plain | {"trajectories": to_json(value.trajectories)}
    if dataclasses.is_dataclass(value):
        return {f.name: to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, np.ndarray):
        if value.size <= ARRAY_ITEMS:
            return value.tolist()
        return {"dtype": str(value.dtype), "shape": list(value.shape), "first": value[:ARRAY_ITEMS].tolist()}
    if isinstance(value, list | tuple | ColumnList):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    return value


def _plain(fields: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in fields.items():
        out[name] = _text(value)
        if name in JSON_FIELDS:
            try:
                out[name] = json.loads(out[name])
            except ValueError:
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
            items = await peek(bus, args.stream, args.count, args.id)
        except KeyError as e:
            print(e.args[0])
            return 1
        for item in items:
            print(json.dumps(item, indent=2))
        return 0

    return asyncio.run(with_bus(settings, show, known=True))

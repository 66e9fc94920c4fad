"""What the bus moves: a delivered entry (`Delivery`), an entry to publish and the limits it must keep
(`check_size`), one unit of a hand-off, and what a dead letter keeps of a field."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from astraflow.errors import MessageTooLarge
from astraflow.streams.schema import Entry

# Statuses of one hand-off item.
OK, DUP, LOST = "ok", "dup", "lost"
MAX_FIELDS = 1000
"""Most fields an entry may have (Lua's unpack limit is near 4000; entries have a handful)."""
DEAD_FIELD_MAX_BYTES = 4096
"""A dead letter copies fields up to this size; a larger one is replaced by its size and sha1."""


@dataclass(frozen=True)
class Delivery:
    """One delivered stream entry: where it was read, its fields, and how often it was delivered."""

    stream: str
    id: str
    fields: dict[str, bytes]
    deliveries: int = 1


class Out(NamedTuple):
    """One entry to publish: target stream, its fields, and an idempotency key (None = no dedup)."""

    stream: str
    fields: Mapping[str, bytes | str]
    dedup: str | None = None


class Item(NamedTuple):
    """One unit of a hand-off: the input to acknowledge (a Delivery, an entry id, or '' for none), the
    entries to publish, and the uid of a prompt group to settle as dead ('' = none)."""

    input: Delivery | str
    outs: Sequence[Out]
    dead_uid: str = ""


def check_size(out: Out, max_entry_bytes: int) -> None:
    """Raise MessageTooLarge when `out` is over `max_entry_bytes` (`streams.max_entry_bytes`) or has no
    field or more than MAX_FIELDS."""
    if not 1 <= len(out.fields) <= MAX_FIELDS:
        raise MessageTooLarge(f"entry for {out.stream}: {len(out.fields)} fields (1 to {MAX_FIELDS})")
    size = sum(map(len, out.fields.values()))
    if size > max_entry_bytes:
        raise MessageTooLarge(
            f"entry for {out.stream}: {size} bytes > streams.max_entry_bytes={max_entry_bytes}"
        )


def dead_field_value(value: bytes | str) -> bytes | str:
    """A field as a dead letter copies it: itself, or when over DEAD_FIELD_MAX_BYTES its size and sha1 (the
    same text as claim.lua writes), so a dead letter stays small whatever it holds."""
    raw = value.encode() if isinstance(value, str) else value
    if len(raw) <= DEAD_FIELD_MAX_BYTES:
        return value
    return f"omitted: {len(raw)} bytes, sha1 {hashlib.sha1(raw).hexdigest()}"


_MAP_HEADS = {0xDE: 3, 0xDF: 5}
"""Bytes of a msgpack map16 / map32 header (a fixmap's is its first byte)."""


def entry_uid(fields: Mapping[str, bytes]) -> str:
    """The prompt group an entry belongs to: the `uid` its msgpack `data` starts with (a message packs its
    fields in order, `uid` first), or '' when it does not start so. Never the plain `uid` field beside it,
    which is for people: whatever decides about a group (dead-lettering, claim.lua, strays.lua) reads
    this. `entry_uid` in streams/lua/common.lua reads the same."""
    data = fields.get(Entry.data)
    if not isinstance(data, bytes) or not data:
        return ""
    head = data[0]
    pos = 1 if 0x80 < head <= 0x8F else 1 + _MAP_HEADS.get(head, -1)
    key, pos = _msgpack_str(data, pos) if pos > 0 else (None, 0)
    if key != Entry.uid.encode():
        return ""
    uid, _ = _msgpack_str(data, pos)
    return uid.decode(errors="replace") if uid is not None else ""


def _msgpack_str(data: bytes, pos: int) -> tuple[bytes | None, int]:
    """The msgpack str (fixstr, str8, str16) at `pos` and the position after it; (None, pos) if none."""
    if pos >= len(data):
        return None, pos
    b = data[pos]
    if 0xA0 <= b <= 0xBF:
        n, at = b - 0xA0, pos + 1
    elif b == 0xD9 and pos + 2 <= len(data):
        n, at = data[pos + 1], pos + 2
    elif b == 0xDA and pos + 3 <= len(data):
        n, at = struct.unpack_from(">H", data, pos + 1)[0], pos + 3
    else:
        return None, pos
    return (data[at : at + n], at + n) if at + n <= len(data) else (None, pos)

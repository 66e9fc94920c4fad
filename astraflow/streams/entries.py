"""What the bus moves: a delivered entry, an entry to publish, one unit of a hand-off, and what a dead
letter keeps of a field."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

# Statuses of one hand-off item.
OK, DUP, LOST = "ok", "dup", "lost"
MAX_FIELDS = 1000
"""Most fields an entry may have (Lua's unpack limit is near 4000; entries have a handful)."""
DEAD_FIELD_MAX_BYTES = 4096
"""A dead letter copies fields up to this size; a larger one is replaced by its size and sha1."""


@dataclass(frozen=True)
class Entry:
    """One delivered stream entry."""

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
    """One unit of a hand-off: the input to acknowledge (an Entry, an entry id, or '' for none), the
    entries to publish, and the uid of a prompt group to settle as dead ('' = none)."""

    input: Entry | str
    outs: Sequence[Out]
    dead_uid: str = ""


def dead_field_value(value: bytes | str) -> bytes | str:
    """A field as a dead letter copies it: itself, or when over DEAD_FIELD_MAX_BYTES its size and sha1 (the
    same text as claim.lua writes), so a dead letter stays small whatever it holds."""
    raw = value.encode() if isinstance(value, str) else value
    if len(raw) <= DEAD_FIELD_MAX_BYTES:
        return value
    return f"omitted: {len(raw)} bytes, sha1 {hashlib.sha1(raw).hexdigest()}"

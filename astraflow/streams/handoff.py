"""What one hand-off call sends to handoff.lua: its keys and arguments, what an item costs against
`streams.max_call_args` / `max_call_bytes`, the binding of each output's dedup marker to its input, and
the item that hands an entry off to `dead` (`dead_letter_item`)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from astraflow.streams.chunks import ARG_OVERHEAD_BYTES
from astraflow.streams.entries import Delivery, Item, Out, dead_field_value, entry_uid
from astraflow.streams.keys import Keys
from astraflow.streams.records import DeadLetterRecord, encode_record
from astraflow.streams.scripts import HANDOFF

BINDING_CHARS = 32
"""Hex digits of a dedup marker's binding (`binding_of`)."""


def binding_of(stream: str, input_id: str, out: Out) -> str:
    """What binds an output's dedup marker to the hand-off that writes it: a digest of the input (stream,
    id) and the output (stream, fields). Nobody without the output's bytes can write a marker that passes
    for it, so a guessed dedup key cannot make a hand-off drop its output."""
    h = hashlib.blake2b(digest_size=BINDING_CHARS // 2)
    for part in (stream, input_id, out.stream, *(x for kv in out.fields.items() for x in kv)):
        data = bytes(part) if isinstance(part, bytes | bytearray | memoryview) else str(part).encode()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def handoff_cost(keys: Keys, item: Item) -> tuple[int, int]:
    """(arguments, bytes) that `item` adds to a hand-off call, counting its keys as new ones (counted, not
    built: this runs for every entry handed off)."""
    input_id = item.input.id if isinstance(item.input, Delivery) else item.input
    n_args, n_bytes = 3, len(input_id) + len(item.dead_uid) + 1
    for out in item.outs:
        n_args += 5 + 2 * len(out.fields)
        n_bytes += len(out.stream) + 3 + BINDING_CHARS + len(str(len(out.fields)))
        n_bytes += len(keys.dedup(out.dedup)) if out.dedup else 0
        n_bytes += sum(len(name) + len(value) for name, value in out.fields.items())
    return n_args, n_bytes + n_args * ARG_OVERHEAD_BYTES


def handoff_call(
    keys: Keys, stream: str, group: str, consumer: str, ttl_ms: int, items: Sequence[Item]
) -> tuple[list[str], list[bytes | str | int]]:
    """The KEYS and ARGV of one handoff.lua call of `items` from `stream` (`scripts.HANDOFF`)."""
    outputs: list[str] = []
    index: dict[str, int] = {}

    def key_index(key: str) -> int:
        if key not in index:
            outputs.append(key)
            index[key] = len(outputs)
        return index[key]

    calls = []
    for entry, outs, dead_uid in items:
        input_id = entry.id if isinstance(entry, Delivery) else entry
        written = []
        for out in outs:
            dedup = key_index(keys.dedup(out.dedup)) if out.dedup else 0
            binding = binding_of(stream, input_id, out) if out.dedup and input_id else ""
            written.append(
                {"stream": key_index(out.stream), "dedup": dedup, "binding": binding, "fields": out.fields}
            )
        calls.append({"input_id": input_id, "dead_uid": dead_uid, "outs": written})
    settle = 0
    if any(item.dead_uid for item in items):  # (only then: a RaaS's user may write neither key)
        settle = len(outputs) + 1
        outputs += [keys.in_flight, keys.ledger]
    return HANDOFF.call(
        input=stream,
        errors=keys.errors,
        outputs=outputs,
        settle=settle,
        group=group,
        consumer=consumer,
        ttl_ms=ttl_ms,
        items=calls,
    )


def dead_letter_item(keys: Keys, entry: Delivery, group: str, consumer: str, reason: str) -> Item:
    """The hand-off of `entry` (owned by `consumer` of `group`) to `dead`: its record with the source, id,
    fields (`dead_field_value`), consumer and reason, written once per entry; an entry of a tracked stream
    also settles its prompt group as dead in the ledger: the group its `data` names (`entry_uid`), never
    one its plain `uid` field names, which is for people."""
    dead_uid = entry_uid(entry.fields) if entry.stream in keys.tracked_streams() else ""
    copied = {k: dead_field_value(v) for k, v in entry.fields.items()}
    where = (entry.stream, reason, entry.id, group, consumer, entry.deliveries)
    letter = DeadLetterRecord(*where, copied, settled=dead_uid)
    out = Out(keys.dead, encode_record(letter), dedup=f"dead:{entry.stream}:{entry.id}")
    return Item(entry, [out], dead_uid)

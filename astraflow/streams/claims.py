"""What one claim.lua call sends and what its reply holds (`scripts.CLAIM`): the keys and arguments of
`Bus.claim` in each of its modes, and the deliveries read back, as `handoff` is for handoff.lua.

An entry delivered once more than `streams.max_deliveries` goes to `dead` (its fields over
DEAD_FIELD_MAX_BYTES replaced by size and sha1), settled in the ledger for a tracked stream; on a stream
whose consumers leave that to the dataflow (`Keys.reaped_streams`) it stays pending for the 'reap' mode,
the only one that then gets the keys to settle it.
"""

from __future__ import annotations

from typing import Literal

from astraflow.streams.entries import DEAD_FIELD_MAX_BYTES, Delivery
from astraflow.streams.keys import Keys
from astraflow.streams.scripts import CLAIM
from astraflow.streams.settings import StreamsSettings

Mode = Literal["own", "others", "reap"]


def claim_call(
    keys: Keys, settings: StreamsSettings, stream: str, mode: Mode, since_ms: int, **scan: object
) -> tuple[list[str], list]:
    """The KEYS and ARGV of one claim.lua call on `stream` (see `Bus.claim` for the modes): 'own' claims
    entries idle since `since_ms`, the others those idle past `streams.lease_ms`; `scan` is the rest of
    the call by the contract's names (group, consumer, start, count, skip), passed as it is."""
    settles = mode == "reap" or stream not in keys.reaped_streams()
    return CLAIM.call(
        stream=stream,
        errors=keys.errors,
        settle=[{"dead": keys.dead, "in_flight": keys.in_flight, "ledger": keys.ledger}] if settles else [],
        mode=mode,
        min_idle=since_ms if mode == "own" else settings.lease_ms,
        max_deliveries=settings.max_deliveries,
        dead_maxlen=settings.capped_maxlen,
        tracked=stream in keys.tracked_streams(),
        max_field_bytes=DEAD_FIELD_MAX_BYTES,
        **scan,
    )


def claimed(stream: str, reply: list) -> tuple[str, list[Delivery]]:
    """(where the next scan starts, '-' once it reached the end; the entries) of a claim.lua `reply`
    (an empty first element with nothing after it: a scan that found nothing to do)."""
    entries = []
    for r in reply[1:]:
        fields = {r[i].decode(): r[i + 1] for i in range(2, len(r), 2)}
        entries.append(Delivery(stream, r[0].decode(), fields, deliveries=int(r[1])))
    return reply[0].decode() or "-", entries

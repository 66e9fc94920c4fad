"""The trainer's side of `batches:<model>`: batches in, owner-checked acknowledgements out.

The dataflow owns the batch entry's layout (headers, `refs` into the `samples:<model>` hash, see
`schema.BatchEntry`, written by form.lua), so it alone reads it: a trainer sees `Received` batches,
never stream keys.
A batch's samples stay in Redis until it is acknowledged; after that they may be gone.

A batch the trainer cannot train on is set aside: dead-lettered with the reason, and its groups counted
`dead` instead of `trained` in the ledger. So is one it died training BATCH_ATTEMPTS times: each step's
attempt is counted in Redis before it starts (`begin`) and forgotten when it ends (`finished`), so the
count survives the crash it is counting and counts no other batch.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import structlog

from astraflow.dataflow.scripts import SET_ASIDE
from astraflow.errors import DecodeError
from astraflow.messages import Batch, batch_refs, decode_batch
from astraflow.streams import LOST, Bus, Consumer, Delivery
from astraflow.streams.connection import register_scripts
from astraflow.streams.entries import DEAD_FIELD_MAX_BYTES
from astraflow.streams.keys import GROUP_TRAINER
from astraflow.streams.schema import Errors
from astraflow.streams.trim import trim

log = structlog.get_logger(__name__)

BATCH_ATTEMPTS = 2
"""Steps a batch may be tried in: one during which the trainer died that many times is set aside (a
poison batch crash-loops the trainer otherwise; two tell a bad batch from one unlucky crash). Fewer when
`streams.max_deliveries` would dead-letter the batch first (at its claim, without the ledger's move)."""


async def fetch_batch(bus: Bus, fields: Mapping, max_bytes: int | None = None) -> Batch:
    """A batch entry with its groups, read from where it refers to (valid until the trainer acks it)."""
    refs = batch_refs(fields)
    model = fields.get("model", fields.get(b"model", b""))
    model = model.decode() if isinstance(model, bytes) else model
    payloads = await bus.call(lambda: bus.redis.hmget(bus.keys.samples(model), refs)) if refs else []
    return decode_batch(fields, payloads, max_bytes)


@dataclass(frozen=True)
class Received:
    """One delivered batch: `id` orders deliveries (a newer batch has a larger id, see
    `checkpoint.entry_order`) and names it in acknowledgements."""

    id: str
    batch: Batch


class BatchReader:
    """Reads one model's batches as the consumer `name` of the trainer group.

    `read` hands out this consumer's own unacknowledged batches first (after a restart under the same
    name), then new ones; an entry that cannot be decoded is dead-lettered, never handed out. Held
    batches keep their leases through `renew`. `ack` acknowledges only what this consumer still owns.
    """

    def __init__(self, bus: Bus, model: str, name: str) -> None:
        self.bus, self.model = bus, model
        self.stream = bus.keys.batches(model)
        self._consumer = Consumer(bus, self.stream, GROUP_TRAINER, name)
        self._next_trim = time.monotonic() + bus.settings.trim_interval_ms / 1000
        self._scripts = register_scripts(
            bus.redis, "astraflow.dataflow", (SET_ASIDE.name,), prelude="common.lua"
        )

    async def open(self) -> None:
        """Create the trainer group if it is missing (only this stream: a trainer's ACL user has no other)."""
        await self.bus.ensure_group(self.stream, GROUP_TRAINER)

    async def read(self, count: int = 1, block_ms: int | None = None) -> list[Received]:
        """Up to `count` batches, waiting up to `block_ms` (default `streams.block_ms`) for new ones."""
        out = []
        for entry in await self._consumer.read(count, block_ms):
            try:
                batch = await fetch_batch(self.bus, entry.fields, self.bus.settings.max_entry_bytes)
            except DecodeError as e:
                log.error("batch_dead_lettered", id=entry.id, error=str(e))
                await self._consumer.dead_letter(entry, f"DecodeError: {e}")
                continue
            out.append(Received(entry.id, batch))
        return out

    async def renew(self) -> list[str]:
        """Renew the leases of the held batches; returns (and stops holding) the ids of those lost to
        another consumer meanwhile."""
        return [e.id for e in await self._consumer.renew()]

    async def ack(self, batches: Sequence[Received]) -> list[str]:
        """Acknowledge `batches` (their samples may be dropped from then on); returns the ids refused
        because another consumer owns them now (or a failover lost their read: they are delivered again).
        Acknowledged entries are trimmed from the stream every `streams.trim_interval_ms`."""
        done = [(Delivery(self.stream, r.id, {}), ()) for r in batches]
        statuses = await self._consumer.complete(done) if done else []
        refused = [r.id for r, status in zip(batches, statuses, strict=True) if status == LOST]
        if time.monotonic() >= self._next_trim:
            self._next_trim = time.monotonic() + self.bus.settings.trim_interval_ms / 1000
            await trim(self.bus, self.stream)
        return refused

    def _fields(self, received: Received) -> tuple[str, str]:
        """The errors-hash fields of a batch's step attempts and of the last error of one."""
        return Errors.attempts(self.stream, received.id), Errors.error(self.stream, received.id)

    async def begin(self, received: Received) -> str | None:
        """Count an attempt to train `received`; returns why it must be set aside instead (the trainer
        died during BATCH_ATTEMPTS steps on it already), else None."""
        attempts_field, error_field = self._fields(received)

        async def count():
            async with self.bus.redis.pipeline(transaction=True) as pipe:
                pipe.hincrby(self.bus.keys.errors, attempts_field, 1).hget(self.bus.keys.errors, error_field)
                return await pipe.execute()

        attempt, error = await self.bus.call(count)
        if attempt <= max(1, min(BATCH_ATTEMPTS, self.bus.settings.max_deliveries - 1)):
            return None
        last = error.decode(errors="replace") if error else "none recorded (killed, or crashed natively)"
        n = attempt - 1
        return f"the trainer died during {n} step{'s' if n > 1 else ''} on it; last error: {last}"

    async def failed(self, received: Received, error: str) -> None:
        """Record why a step on `received` failed (the trainer is going down): its dead letter says it."""
        _, error_field = self._fields(received)
        await self.bus.call(lambda: self.bus.redis.hset(self.bus.keys.errors, error_field, error[:2000]))

    async def finished(self, received: Received) -> None:
        """The step on `received` ended (trained or refused): forget its attempts."""
        fields = self._fields(received)
        await self.bus.call(lambda: self.bus.redis.hdel(self.bus.keys.errors, *fields))

    async def set_aside(self, received: Received, reason: str) -> str:
        """Dead-letter `received` with `reason` and count its groups dead, not trained, in the ledger (see
        set_aside.lua); returns 'ok', 'dup' (it was already) or 'lost' (another consumer owns it now)."""
        k = self.bus.keys
        attempts_field, error_field = self._fields(received)
        keys, args = SET_ASIDE.call(
            batches=self.stream,
            dead=k.dead,
            errors=k.errors,
            ledger=k.ledger,
            group=GROUP_TRAINER,
            consumer=self._consumer.name,
            id=received.id,
            model=self.model,
            reason=reason,
            dead_maxlen=self.bus.settings.capped_maxlen,
            max_field_bytes=DEAD_FIELD_MAX_BYTES,
            attempts_field=attempts_field,
            error_field=error_field,
        )
        status = await self.bus.hand_off_script(self._scripts[SET_ASIDE.name], keys, args)
        self._consumer.settled([received.id])
        return status.decode()

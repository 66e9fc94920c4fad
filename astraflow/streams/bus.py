"""The Redis Streams bus: bootstrap, publish, atomic hand-off, leases, reclaim, dead letters.

Every write is idempotent so that a command retried after a lost reply changes nothing twice: outputs carry
dedup keys, and acknowledgements, renewals and releases are owner-checked Lua scripts. A call with many
entries goes to Redis as several within `streams.max_call_args` and `max_call_bytes` (see `chunks`), each
entry whole in one of them.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Sequence

import redis.asyncio as aioredis
import structlog
from redis.exceptions import ResponseError

from astraflow.errors import BusError
from astraflow.streams.chunks import arg_bytes, chunked
from astraflow.streams.claims import Mode, claim_call, claimed
from astraflow.streams.connection import reconnecting, register_scripts
from astraflow.streams.contract import Contract
from astraflow.streams.entries import Delivery, Item, Out, check_size
from astraflow.streams.handoff import dead_letter_item, handoff_call, handoff_cost
from astraflow.streams.identity import RunIdentity, new_identity
from astraflow.streams.keys import STRAY_GRACE_MS, Keys
from astraflow.streams.replica import ReplicaReads, connect_clients, replicated
from astraflow.streams.schema import Errors
from astraflow.streams.scripts import CLAIM, CREATE_RUN, HANDOFF, RELEASE, RENEW
from astraflow.streams.settings import RedisSettings, StreamsSettings

log = structlog.get_logger(__name__)


class Bus:
    """One run's streams on one Redis. Commands use `client`; blocking reads use `blocking`.

    `reconnect_max_s` is how long a call waits for an unreachable or refusing Redis before it raises
    BusConnectionError: a budget for one-shot commands, `math.inf` for long-running workers, which wait
    out any outage. `failures` counts failed attempts: a consumer rescans its own entries after a claim's
    lost reply, and waits a lease after Redis was away before it reclaims other consumers' entries.
    """

    def __init__(
        self,
        keys: Keys,
        settings: StreamsSettings,
        client: aioredis.Redis,
        blocking: aioredis.Redis,
        reconnect_max_s: float = 60.0,
        *,
        reader: ReplicaReads | None = None,
        min_replicas_ack: int = 0,
        replica_ack_timeout_ms: int = 1000,
    ) -> None:
        self.keys = keys
        self.reconnect_max_s = reconnect_max_s
        self.settings = settings
        self.redis = client
        self.blocking = blocking
        self._scripts = register_scripts(client)
        self.failures = 0
        self.reader = reader or ReplicaReads(None, None)
        """Read-only traffic off a replica (`read_only`); `reader.stats` counts where reads went."""
        self.min_replicas_ack, self.replica_ack_timeout_ms = min_replicas_ack, replica_ack_timeout_ms

    @classmethod
    def connect(
        cls,
        url: str,
        run: str,
        redis_settings: RedisSettings,
        settings: StreamsSettings,
        *,
        wait_out: bool = False,
    ) -> Bus:
        """A bus on `url`. `wait_out`: calls wait out any Redis outage (long-running workers) instead of
        raising after `redis.reconnect_max_s`."""
        r = redis_settings
        client, replica = connect_clients(url, r)
        # Blocking reads get their own pool with a socket timeout longer than the block.
        blocking, replica_blocking = connect_clients(
            url, r, read_timeout_s=settings.block_ms / 1000 + r.socket_timeout_s
        )
        budget = math.inf if wait_out else r.reconnect_max_s
        reader = ReplicaReads(replica, replica_blocking)
        ack = {"min_replicas_ack": r.min_replicas_ack, "replica_ack_timeout_ms": r.replica_ack_timeout_ms}
        return cls(Keys(run), settings, client, blocking, budget, reader=reader, **ack)

    async def close(self) -> None:
        await self.redis.aclose()
        await self.blocking.aclose()
        await self.reader.close()

    async def read_only(self, command, *, blocking: bool = False, fresh=lambda _: True):
        """`command(client)`, a read-only command, off the replica when there is one (see `ReplicaReads`;
        a reply that is not `fresh` there is asked of the primary), else on the primary: through
        reconnects, or for `blocking` reads on the blocking pool as they are."""
        if blocking:
            return await self.reader.read(command, lambda: command(self.blocking), blocking=True, fresh=fresh)
        primary = lambda: self.call(lambda: command(self.redis))  # noqa: E731
        return await self.reader.read(command, primary, fresh=fresh)

    async def bootstrap(self, models: Sequence[str]) -> RunIdentity:
        """Create the run's identity (unless it has one), every stream and every consumer group of the
        run; safe to call any number of times. Returns the identity."""
        identity = await self.identity()  # first: keys without an identity are another run's leftovers
        for stream, group in self.keys.grouped_streams(list(models)).items():
            await self.ensure_group(stream, group)
        return identity

    async def identity(self) -> RunIdentity:
        """The run's identity, created now if it has none (atomic: concurrent bootstraps get the same)."""
        reply = await self.run_script(CREATE_RUN, identity=self.keys.identity, **new_identity())
        return RunIdentity.parse(*reply)

    async def ensure_group(self, stream: str, group: str) -> None:
        try:
            # From id 0: entries published before the group existed are delivered too.
            await self.call(lambda: self.redis.xgroup_create(stream, group, id="0", mkstream=True))
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    async def call(self, call, on_lost=None):
        """Run `call` (an idempotent command or script) through reconnects, within the budget; `on_lost`
        runs after each failure. Raises RequestRefused when Redis keeps closing the connection on this
        call while it answers a PING (see `reconnecting`)."""

        def lost() -> None:
            self.failures += 1
            if on_lost is not None:
                on_lost()

        return await reconnecting(call, self.reconnect_max_s, lost, probe=self.redis.ping)

    async def run_script(self, contract: Contract, **values):
        """Run the bus's script of `contract` with its keys and arguments by name, through reconnects."""
        keys, args = contract.call(**values)
        return await self.call(lambda: self._scripts[contract.name](keys=keys, args=args))

    # -- producing -------------------------------------------------------------------------------------

    async def publish(self, out: Out) -> str:
        """XADD one entry (at most once per dedup key); returns its id, or the existing id of a duplicate."""
        return (await self.publish_many([out]))[0]

    async def publish_many(self, outs: Sequence[Out]) -> list[str]:
        """Publish several entries, each at most once while its dedup key lives; an entry without one gets
        one for this call, so a retry after a lost reply cannot publish it twice. Within
        `streams.max_call_args` / `max_call_bytes` it is one atomic step, beyond several (in order): a
        failure part-way leaves the earlier steps' entries published, and publishing again with the same
        dedup keys adds only the rest."""
        token = uuid.uuid4().hex
        keyed = [o if o.dedup else o._replace(dedup=f"call:{token}:{i}") for i, o in enumerate(outs)]
        # No input to acknowledge: the "input stream" is just some key of the run (same hash slot).
        replies = await self.handoff(self.keys.errors, "", "", [("", [o]) for o in keyed])
        return [ids[0] for _, ids in replies]

    async def handoff(
        self, stream: str, group: str, consumer: str, items: Sequence[tuple]
    ) -> list[tuple[str, list[str]]]:
        """Acknowledge each item's input and publish its outputs (`Item`s, or (input, outs) tuples).

        Each item happens in one atomic step, and items go together in one step within
        `streams.max_call_args` / `max_call_bytes`, else in several (in order; a retry of a step that
        was done finds its items 'dup'). Every output's size is checked (`entries.check_size`) before anything
        is written. Per item the reply is (status, output ids): OK; DUP when every output already
        existed (a retry of a call whose reply was lost); LOST when the input is no longer owned by
        `consumer` (it was reclaimed, or its read was lost in a failover) - then nothing of that item was
        written.
        """
        whole = [Item(*item) for item in items]
        for item in whole:
            for out in item.outs:
                check_size(out, self.settings.max_entry_bytes)
        replies: list[tuple[str, list[str]]] = []
        for chunk in self._chunks(whole, lambda item: handoff_cost(self.keys, item)):
            replies += await self._handoff(stream, group, consumer, chunk)
        return replies

    def _chunks(self, items, cost):
        return chunked(items, cost, self.settings.max_call_args, self.settings.max_call_bytes)

    async def _handoff(self, stream: str, group: str, consumer: str, items: list[Item]):
        """One hand-off script call of `items` (see handoff.lua)."""
        keys, args = handoff_call(self.keys, stream, group, consumer, self.dedup_ttl_ms, items)
        try:
            replies, ignored = await self.hand_off_script(self._scripts[HANDOFF.name], keys, args)
        except ResponseError as e:
            raise BusError(f"hand-off refused: {e}") from None
        for key in ignored:
            log.warning("dedup_marker_ignored", key=key.decode(), reason="not written by this hand-off")
        return [(r[0].decode(), [i.decode() for i in r[1:]]) for r in replies]

    @property
    def dedup_ttl_ms(self) -> int:
        """How long a dedup marker lives: the group's lease budget - `lease_ms` x `max_deliveries`, the
        longest its input is delivered before it is dead-lettered, plus STRAY_GRACE_MS - capped by
        `streams.dedup_ttl_ms`. A retried hand-off needs no longer: its input, once acknowledged, answers
        'dup' by itself."""
        budget = self.settings.lease_ms * self.settings.max_deliveries + STRAY_GRACE_MS
        return min(self.settings.dedup_ttl_ms, budget)

    async def hand_off_script(self, script, keys: list[str], args: list):
        """Run an idempotent script that hands work off (through reconnects), returning its reply only
        once `redis.min_replicas_ack` replicas have its writes, so that an acknowledged hand-off survives a
        failover."""
        if not self.min_replicas_ack:
            return await self.call(lambda: script(keys=keys, args=args))
        n, timeout, marker = self.min_replicas_ack, self.replica_ack_timeout_ms, self.keys.dedup("replicated")
        return await self.call(lambda: replicated(self.redis, script, keys, args, n, timeout, marker))

    # -- consuming -------------------------------------------------------------------------------------

    async def read(
        self, stream: str, group: str, consumer: str, count: int, block_ms: int | None
    ) -> list[Delivery]:
        """XREADGROUP of new entries ('>') on the blocking pool."""
        reply = await self.blocking.xreadgroup(group, consumer, {stream: ">"}, count=count, block=block_ms)
        return [
            Delivery(stream, entry_id.decode(), {k.decode(): v for k, v in fields.items()})
            for _, items in reply or []
            for entry_id, fields in items
        ]

    async def ack(self, stream: str, group: str, ids: Sequence[str]) -> None:
        """Acknowledge entries that need no hand-off (their effect is durable elsewhere), clearing any
        error recorded for them, in one transaction per `streams.max_call_args` / `max_call_bytes`."""

        async def ack(chunk: list[str]) -> None:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.xack(stream, group, *chunk)
                pipe.hdel(self.keys.errors, *(Errors.entry(stream, i) for i in chunk))
                await pipe.execute()

        for chunk in self._chunks(ids, lambda i: (2, arg_bytes([i, Errors.entry(stream, i)]))):
            await self.call(lambda chunk=chunk: ack(chunk))

    async def renew(self, stream: str, group: str, consumer: str, ids: Sequence[str]) -> list[str]:
        """Reset the lease of entries `consumer` still owns; returns the ids it lost to a reclaim."""
        lost = []
        for chunk in self._chunks(ids, lambda i: (1, arg_bytes([i]))):
            lost += await self.run_script(RENEW, stream=stream, group=group, consumer=consumer, ids=chunk)
        return [i.decode() for i in lost]

    async def release(self, stream: str, group: str, consumer: str, entry_id: str, reason: str) -> bool:
        """Give an owned entry back for redelivery now, recording `reason`; False if no longer owned."""
        errors = self.keys.errors
        reply = await self.run_script(
            RELEASE, stream=stream, errors=errors, group=group, consumer=consumer, id=entry_id, reason=reason
        )
        return bool(reply)

    async def claim(
        self,
        stream: str,
        group: str,
        consumer: str,
        *,
        mode: Mode,
        start: str,
        count: int,
        skip: Sequence[str] = (),
        since_ms: int = 0,
    ) -> tuple[str, list[Delivery]]:
        """Claim pending entries (see claim.lua); an entry to be delivered once more than max_deliveries
        goes to `dead`, or, on a stream whose consumers leave that to the dataflow
        (`Keys.reaped_streams`), stays pending for its 'reap'.

        `mode='others'`: other consumers' entries idle past the lease (a delivery). `'own'`: this
        consumer's own pending entries except `skip` (what it still holds); a delivery only for those
        released or delivered before `since_ms` (Redis time when the consumer started: to a crashed
        predecessor of the same name), not for those it lost track of. `'reap'`: claims nothing, but
        dead-letters the entries of any consumer idle past the lease and delivered max_deliveries times
        (returned without fields). Scans from `start`; returns where the next call should start ('-' once
        the scan reached the end) and the entries.
        """
        scan = {"group": group, "consumer": consumer, "start": start, "count": count, "skip": skip}
        keys, args = claim_call(self.keys, self.settings, stream, mode, since_ms, **scan)
        failures = self.failures

        async def attempt():
            if mode != "own" and self.failures != failures:  # Redis went away meanwhile: idle times now
                return [b""]  # include the outage, so no reclaim until the consumer's wait has passed
            return await self._scripts[CLAIM.name](keys=keys, args=args)

        return claimed(stream, await self.call(attempt))

    async def dead_letter(self, entry: Delivery, group: str, consumer: str, reason: str) -> str:
        """Move an owned entry to `dead` and ack it, in one hand-off (`handoff.dead_letter_item`: its
        record, and the settling of a tracked stream's prompt group); returns the hand-off's status."""
        item = dead_letter_item(self.keys, entry, group, consumer, reason)
        [(status, _)] = await self.handoff(entry.stream, group, consumer, [item])
        return status

"""One live process per consumer name: the owner checks of the bus tell consumers apart by name alone.

A worker holds its name for as long as it runs: the key `name:<role>:<name>` (each role's ACL user may
write only its own role's names, so no RaaS credential can take over the trainer's name) carries
`host~pidns pid token` with a TTL of one lease, renewed every third of it. A process that finds the name
held waits for the holder's TTL to run out (a holder that was killed stops renewing), taking it over at
once from a dead pid of its own host and PID namespace (the supervisor restarting a worker under its fixed
name); a name still renewed after that belongs to a live process, and the start is refused. A process
whose name another took over (it expired while Redis was unreachable) stops.

What a worker publishes about itself under its name - its heartbeat `raas:<name>` - is written only
while it holds the name (`write_heartbeat`, checked in the same script) and carries the holder, so a
reader counts a heartbeat only when its `holder` field is the name's current holder (`heartbeat_holder`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import time
from collections.abc import AsyncIterator

import structlog

from astraflow import processes
from astraflow.errors import AstraflowError, describe
from astraflow.streams.bus import Bus
from astraflow.streams.connection import raise_if_cancelled, register_scripts
from astraflow.streams.scripts import BEAT, FREE_NAME, TAKE_NAME

log = structlog.get_logger(__name__)

HOLDER_FIELD = "holder"
_held: dict[str, str] = {}
"""Name key -> this process's holder value, for each name it holds now."""


class NameInUse(AstraflowError):
    """Another live process runs under this consumer name."""


def _gone(holder: str) -> bool:
    space, pid, _ = holder.split(" ", 2)
    return processes.gone(space, int(pid))


@contextlib.asynccontextmanager
async def hold_name(
    bus: Bus, name: str, setting: str = "its id setting", *, role: str
) -> AsyncIterator[None]:
    """Hold consumer name `name` of a `role` worker while the body runs; raise NameInUse if a live process
    holds it."""
    key = name_key(bus, role, name)
    me = f"{processes.pid_space()} {os.getpid()} {secrets.token_hex(4)}"
    ttl_ms = bus.settings.lease_ms
    scripts = register_scripts(bus.redis, names=(TAKE_NAME.name, FREE_NAME.name))
    take = scripts[TAKE_NAME.name]
    deadline = time.monotonic() + 1.5 * ttl_ms / 1000
    expected = me
    while True:
        keys, args = TAKE_NAME.call(name=key, holder=me, ttl_ms=ttl_ms, expected=expected)
        held = await bus.call(lambda keys=keys, args=args: take(keys=keys, args=args))
        if not held:
            break
        held = held.decode()
        if _gone(held):
            expected = held
            continue
        if time.monotonic() > deadline:
            raise NameInUse(
                f"consumer name {name!r} is held by a live process ({held.rsplit(' ', 1)[0]}): "
                f"give each process its own name ({setting}) or leave it unset"
            )
        log.info("name_held_waiting", name=name, holder=held)
        await asyncio.sleep(min(1.0, ttl_ms / 3000))
    _held[key] = me
    lost: list[str] = []
    renew = asyncio.create_task(_renew(bus, take, key, me, ttl_ms, asyncio.current_task(), lost))
    try:
        yield
    except asyncio.CancelledError:
        if lost:  # two live processes must not share a name: this one gives way
            raise NameInUse(
                f"consumer name {name!r} was taken over by {lost[0]} while Redis lost it"
            ) from None
        raise
    finally:
        _held.pop(key, None)
        renew.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await renew
        with contextlib.suppress(Exception):
            keys, args = FREE_NAME.call(name=key, holder=me)
            await scripts[FREE_NAME.name](keys=keys, args=args)


async def _renew(bus: Bus, take, key: str, me: str, ttl_ms: int, owner, lost: list[str]) -> None:
    """Renew the name every third of its TTL; if another process holds it now (it expired while Redis
    was unreachable), record who and cancel `owner`, the task running under the name."""
    keys, args = TAKE_NAME.call(name=key, holder=me, ttl_ms=ttl_ms, expected=me)
    while True:
        await asyncio.sleep(ttl_ms / 3000)
        try:
            held = await bus.call(lambda: take(keys=keys, args=args))
        except Exception as e:  # Redis down: the bus waits it out elsewhere; try again next time
            raise_if_cancelled()
            log.warning("name_renewal_failed", key=key, error=describe(e))
            continue
        if held:
            lost.append(held.decode())
            log.error("name_taken_over", key=key, holder=lost[0])
            owner.cancel()
            return


def name_key(bus: Bus, role: str, name: str) -> str:
    """The key of consumer name `name` of a `role` worker (`raas`, `dataflow`, `trainer`)."""
    return bus.keys.consumer_name(f"{role}:{name}")


def held(bus: Bus, name: str, role: str = "raas") -> str | None:
    """This process's holder value of consumer name `name`, or None when it does not hold it."""
    return _held.get(name_key(bus, role, name))


async def write_heartbeat(bus: Bus, name: str, fields: dict, ttl_ms: int) -> bool:
    """Replace the heartbeat `raas:<name>` with `fields` (expiring in `ttl_ms`), only while this process
    holds `name`; False (nothing written) otherwise. One attempt: a missed beat is not retried."""
    me = held(bus, name)
    if me is None:
        return False
    keys, args = BEAT.call(
        name=name_key(bus, "raas", name),
        heartbeat=bus.keys.raas(name),
        holder=me,
        ttl_ms=ttl_ms,
        holder_field=HOLDER_FIELD,
        fields=fields,
    )
    beat = register_scripts(bus.redis, names=(BEAT.name,))[BEAT.name]
    return bool(await beat(keys=keys, args=args))


async def heartbeat_holder(bus: Bus, name: str, fields: dict) -> bool:
    """Whether the heartbeat `fields` of worker `name` was written by the name's current holder."""
    holder = await bus.call(lambda: bus.redis.get(name_key(bus, "raas", name)))
    return holder is not None and fields.get(HOLDER_FIELD.encode(), fields.get(HOLDER_FIELD)) == holder

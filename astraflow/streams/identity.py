"""A run's identity: created once, when the run is bootstrapped, and checked by whoever starts one.

The hash `af:{R}:run` holds the run's `nonce` (random: it tells apart two runs that share the name R)
and its `created` time. It is written by whoever creates the run and never by a worker role's ACL user
(workers only read it): on a shared Redis with per-role users, `astraflow redis acl --apply` creates it
(`provision`), with the weight-transfer secret. Whoever ends the run writes `stopped`, `stop_reason` and
`stopped_by` into the hash `af:{R}:run:stop` (`astraflow run`, or a worker that found a stop condition met:
`launch.stops`; the judges' ACL users may write it, no one else's), and every worker follows that notice.
The nonce is part of every batch uid and of every trainer checkpoint, so that nothing of another run of
the same name (keys left on a shared Redis, a checkpoint directory outside the run directory) passes for
this run's.

Starting a process of run R is one of:
- fresh: no key of R exists; the first process to bootstrap creates the identity (the launcher, or on
  a cluster whichever worker comes first: the others join it);
- join: the run exists and was not stopped - a worker joining a running run (RaaS added to a cluster);
- resume (`--resume`): continue a stopped run, or adopt keys that have no identity.
`astraflow run` without `--resume` is always fresh: it refuses as soon as any key of R exists.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from redis.exceptions import ResponseError

from astraflow.errors import RunExistsError
from astraflow.streams.connection import script_source
from astraflow.streams.keys import Keys
from astraflow.streams.schema import Identity, StopNotice
from astraflow.streams.scripts import CREATE_RUN

if TYPE_CHECKING:
    from astraflow.streams.bus import Bus

SCAN_COUNT = 1000


@dataclass(frozen=True)
class RunIdentity:
    nonce: str
    created: float
    """Unix seconds."""
    stopped: float | None = None

    @classmethod
    def parse(cls, nonce: bytes, created: bytes, stopped: bytes | None = None) -> RunIdentity:
        return cls(nonce.decode(), float(created), float(stopped) if stopped else None)


def new_identity() -> dict[str, str]:
    """The arguments of `create_run.lua`: a fresh nonce and the creation time."""
    return {"nonce": secrets.token_hex(6), "created": f"{time.time():.3f}"}


async def existing(bus: Bus) -> RunIdentity | None:
    """The run's identity, or None (never creates one)."""
    fields = [Identity.nonce, Identity.created]
    nonce, created = await bus.call(lambda: bus.redis.hmget(bus.keys.identity, fields))
    if nonce is None:
        return None
    stopped = await bus.call(lambda: bus.redis.hget(bus.keys.stop, StopNotice.stopped))
    return RunIdentity.parse(nonce, created, stopped)


async def keys_of(bus: Bus, first_only: bool = False) -> list[bytes]:
    """Every key of the run (SCAN on its prefix; the first one found, with `first_only`)."""
    found: list[bytes] = []
    pattern = bus.keys.prefix + "*"
    async for key in bus.redis.scan_iter(match=pattern, count=SCAN_COUNT):
        found.append(key)
        if first_only:
            break
    return found


async def _used(bus: Bus, fresh: bool) -> bool:
    """Whether keys of the run exist. A fresh start looks at every key (SCAN); a worker, whose ACL user may
    not SCAN, at the keys every run writes first and every role may read (the run's state and ledger, and
    its versions)."""
    if fresh:
        return bool(await keys_of(bus, first_only=True))
    k = bus.keys
    return bool(await bus.call(lambda: bus.redis.exists(k.state, k.ledger, k.versions)))


async def open_run(bus: Bus, *, fresh: bool, resume: bool) -> RunIdentity:
    """Check that this process may start as asked, and return the run's identity (created if fresh).

    `fresh` (`astraflow run` without `--resume`): refuse when any key of the run exists. Otherwise (a
    worker): join a run that exists and was not stopped, create one where no key exists, and refuse a
    stopped run or keys without an identity. `resume`: continue a stopped run, or adopt keys without an
    identity; refuse when there is nothing to resume."""
    current = await existing(bus)
    if current is None and await _used(bus, fresh):
        current = await existing(bus)  # created meanwhile by a process bootstrapping this run: join it
        if current is None and not resume:
            raise RunExistsError(f"{_describe(bus, None)} {_how(bus)}")
    if resume:
        if current is None and not await _used(bus, fresh):
            raise RunExistsError(f"nothing to resume: no key of run {bus.keys.run!r} on this Redis")
        if current is not None and current.stopped is not None:
            await _unstop(bus)
        return await _identity(bus, current)
    if current is not None and (fresh or current.stopped is not None):
        raise RunExistsError(f"{_describe(bus, current)} {_how(bus)}")
    return await _identity(bus, current)


def _refused(e: ResponseError) -> bool:
    """Whether `e` is an ACL refusal (of a command, or of a command inside a script)."""
    return "perm" in str(e).lower() or "can't access" in str(e)


async def _unstop(bus: Bus) -> None:
    try:
        await bus.call(lambda: bus.redis.delete(bus.keys.stop))
    except ResponseError as e:
        if not _refused(e):
            raise
        raise RunExistsError(
            f"run {bus.keys.run!r} was stopped and this user may not resume it (only the admin and the"
            " dataflow's and trainer's users may): resume it with one of them (`astraflow run --resume`)"
        ) from None


async def _identity(bus: Bus, current: RunIdentity | None) -> RunIdentity:
    """The identity read (`current`, unstopped now), else created: a worker ACL user may not create it."""
    if current is not None:
        return RunIdentity(current.nonce, current.created)
    try:
        return await bus.identity()
    except ResponseError as e:  # NOPERM, from the script's HSET
        if not _refused(e):
            raise
        raise RunExistsError(
            f"run {bus.keys.run!r} has no identity and this user may not create it: whoever creates the run"
            f" does (`astraflow redis acl --apply --run {bus.keys.run}` on a Redis with per-role users)"
        ) from None


async def provision(client, keys: Keys) -> RunIdentity:
    """Create the run's identity and weight-transfer secret unless they exist (an admin `client`): what
    workers under per-role ACL users read and may not write."""
    call_keys, args = CREATE_RUN.call(identity=keys.identity, **new_identity())
    script = script_source(CREATE_RUN.name)
    reply = await client.eval(script, len(call_keys), *call_keys, *args)
    await client.set(keys.weights_secret, secrets.token_hex(32), nx=True)
    return RunIdentity.parse(*reply)


async def mark_stopped(bus: Bus, reason: str | None = None, by: str = "") -> None:
    """Record that the run was ended (and why, and `by` whom: `launcher`, or the role of the worker that
    judged it): its workers stop, and a worker started later does not join it unless resuming. Whoever
    may write the notice may write any reason: a launcher trusts none it did not judge itself
    (`launch.stops`)."""
    fields = {
        StopNotice.stopped: f"{time.time():.3f}",
        StopNotice.stop_reason: reason,
        StopNotice.stopped_by: by,
    }
    written = {name: value for name, value in fields.items() if value}
    await bus.call(lambda: bus.redis.hset(bus.keys.stop, mapping=written))


async def forget(bus: Bus, created: RunIdentity) -> bool:
    """Delete the identity `created` (one this process made when it started a run that had no key), unless
    anything else of the run exists meanwhile (another process joined and wrote to it). A start that
    failed leaves no run behind, so a fresh `astraflow run` of that name is not refused."""
    current = await existing(bus)
    if current is None or current.nonce != created.nonce or await _used(bus, fresh=False):
        return False
    await bus.call(lambda: bus.redis.delete(bus.keys.identity))
    return True


async def clear(bus: Bus) -> int:
    """Delete every key of the run; returns how many."""
    keys = await keys_of(bus)
    for i in range(0, len(keys), SCAN_COUNT):
        chunk = keys[i : i + SCAN_COUNT]
        await bus.call(lambda c=chunk: bus.redis.unlink(*c))
    return len(keys)


def _describe(bus: Bus, run: RunIdentity | None) -> str:
    if run is None:
        return f"keys of run {bus.keys.run!r} ({bus.keys.prefix}*) exist on this Redis, but no run identity;"
    when = f"created {_utc(run.created)}" + (f", stopped {_utc(run.stopped)}" if run.stopped else "")
    return f"run {bus.keys.run!r} already exists on this Redis ({when});"


def _how(bus: Bus) -> str:
    return (
        "continue it with --resume (`astraflow run --resume RUN_DIR`), delete its keys with"
        f" `astraflow clear --run {bus.keys.run}`, or give this run another name (--run NAME)"
    )


def _utc(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")

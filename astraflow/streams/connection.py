"""Redis clients with reconnect-and-backoff, and the Lua scripts registered once per client."""

from __future__ import annotations

import asyncio
import functools
import random
import re
import time
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import TypeVar

import redis.asyncio as aioredis
import structlog
from redis.asyncio.retry import Retry  # (the asyncio one: a sync Retry warns on every client)
from redis.backoff import NoBackoff
from redis.exceptions import (
    AuthenticationError,
    AuthorizationError,
    ConnectionError,
    NoScriptError,
    ResponseError,
    TimeoutError,
)

from astraflow.errors import BusConnectionError, BusError, describe
from astraflow.streams.contract import declared, includes
from astraflow.streams.functions import FunctionMissing, Script
from astraflow.streams.lean import LeanRedis, lean_connections
from astraflow.streams.schema import lua_prelude
from astraflow.streams.settings import RedisSettings

T = TypeVar("T")
log = structlog.get_logger(__name__)

BACKOFF_CAP_S = 0.5
SCRIPT_NAMES = ("handoff", "renew", "release", "claim", "trim", "create_run")


def make_client(url: str, settings: RedisSettings, *, read_timeout_s: float | None = None) -> aioredis.Redis:
    """A client that never retries by itself: `reconnecting` owns retries and the reconnect budget.

    `read_timeout_s` is for connections that block (XREADGROUP BLOCK): it must exceed the block time.
    """
    tls = {}
    if url.startswith("rediss://"):
        files = {"ssl_ca_certs": settings.tls_ca_file, "ssl_certfile": settings.tls_cert_file}
        files["ssl_keyfile"] = settings.tls_key_file
        tls = {k: str(v) for k, v in files.items() if v is not None}
    kwargs = client_kwargs(settings, read_timeout_s)
    return lean_connections(LeanRedis.from_url(url, **credentials(settings), **tls, **kwargs))


def credentials(settings: RedisSettings) -> dict[str, str]:
    """The user and password a client authenticates with (`redis.password` or `redis.password_file`)."""
    found = {"username": settings.username} if settings.username else {}
    if password := settings.secret():
        found["password"] = password
    return found


def client_kwargs(settings: RedisSettings, read_timeout_s: float | None) -> dict:
    """What every client is made with: no retries of its own, RESP2 everywhere (Redis 6.2, 7.x and
    fakeredis then give the same reply shapes), bytes."""
    return {
        "protocol": 2,
        "socket_timeout": read_timeout_s or settings.socket_timeout_s,
        "socket_connect_timeout": settings.socket_timeout_s,
        "retry": Retry(NoBackoff(), 0),
        "decode_responses": False,
    }


@functools.cache  # (the files do not change while a process runs; some callers register per call)
def script_source(name: str, package: str = "astraflow.streams", prelude: str | None = None) -> str:
    """The whole source of script `<package>/lua/<name>.lua` as Redis runs it: the schema's names
    (`schema.lua_prelude`), the helpers every script shares (`astraflow/streams/lua/common.lua`), the
    package's `prelude` file and its contract's `Key` and `Arg` (`contract.Contract.lua`, with the Lua parts
    it includes) prepended. The same text is registered here and loaded as a function by `astraflow redis
    acl --apply` (`functions.load`): its digest names both. ValueError when the script breaks its contract
    (`Contract.check`)."""
    lua = resources.files(package) / "lua"
    head = (resources.files("astraflow.streams") / "lua" / "common.lua").read_text() + "\n"
    head += (lua / prelude).read_text() + "\n" if prelude else ""
    contract = declared(package, name)
    body = includes(contract, lua) + (lua / f"{name}.lua").read_text()
    contract.check(body)
    text = head + contract.lua() + body
    return lua_prelude(text) + text


def register_scripts(
    client: aioredis.Redis,
    package: str = "astraflow.streams",
    names: tuple[str, ...] = SCRIPT_NAMES,
    prelude: str | None = None,
) -> dict[str, Script]:
    """`<package>/lua/<name>.lua` (`script_source`) as a callable each, `await script(keys=..., args=...)`:
    FCALL of its function under a per-role user, else EVALSHA, reloaded on NOSCRIPT (`functions.Script`)."""
    return {name: Script(client, script_source(name, package, prelude)) for name in names}


async def with_script(
    client: aioredis.Redis,
    script: Script,
    fill: Callable[[aioredis.client.Pipeline], None],
    transaction: bool,
) -> list:
    """Execute one pipeline that `fill` queues, `script` among its commands by `queue_script`: the replies.
    The script goes by its name alone (no `SCRIPT EXISTS` round trip before every execute); under EVALSHA it
    is loaded only when Redis answers NOSCRIPT (it restarted), then the pipeline runs again, so whatever
    else `fill` queues must be idempotent. A missing function raises `FunctionMissing` (waited out)."""

    async def execute() -> list:
        async with client.pipeline(transaction=transaction) as pipe:
            fill(pipe)
            return await pipe.execute()

    try:
        try:
            return await execute()
        except NoScriptError:
            await script.reload(client)
            return await execute()
    except ResponseError as e:
        missing = script.missing(e)
        if missing is e:
            raise
        raise missing from None


def queue_script(pipe: aioredis.client.Pipeline, script: Script, keys: list, args: list) -> None:
    """Queue `script` (a registered one) on `pipe` by its name alone (see `with_script`)."""
    script.queue(pipe, keys, args)


TRANSIENT_CODES = frozenset(
    {"OOM", "BUSY", "LOADING", "READONLY", "MISCONF", "TRYAGAIN", "CLUSTERDOWN", "MASTERDOWN", "NOREPLICAS"}
)
"""Error replies of a Redis that is up but cannot serve writes for now (out of memory, loading its data,
a replica being promoted, a failing disk, too few replicas in sync): waited out like a lost connection,
never blamed on an entry."""
EXHAUSTED = "exhausted the last possible ID"
"""In the error of an XADD to a stream that holds an entry with the largest id (written by someone with
the right to XADD it an explicit id: an attack): nothing can be added until an admin deletes it and sets
the stream's last id back (docs/security.md). Waited out like the codes above, so that no entry (no prompt
group) is dead-lettered for it: the run stands still, its time limit holds, and the log says why."""
_SCRIPT_CODE = re.compile(r": -([A-Z]+) ")  # Redis 6.2 wraps a script's failed call as "...: -OOM ..."
REPORT_EVERY_S = 10.0
"""While Redis stays unreachable, `reconnecting` logs `redis_unreachable` this often."""
REFUSED_AFTER = 3
"""A request whose connection Redis closes this many times in a row, while it answers a probe after each,
is refused for good (`RequestRefused`), not waiting out an outage."""


class RequestRefused(BusError):
    """Redis keeps closing the connection on one request while it answers others (a request past what it
    accepts, e.g. more than 1,048,576 arguments on Redis 6.2): sending it again cannot help."""


def is_transient(e: BaseException) -> bool:
    """Whether `e` says Redis is away or refusing for now (retry later), not that the call is wrong (nor
    that this client may not use it)."""
    if isinstance(e, AuthenticationError | AuthorizationError):  # WRONGPASS, NOAUTH: fatal, though
        return False  # redis-py makes them ConnectionErrors (NOPERM is a reply: never transient either)
    if isinstance(e, ConnectionError | TimeoutError | BusConnectionError | FunctionMissing):
        return True
    if not isinstance(e, ResponseError):
        return False
    code = getattr(e, "status_code", None) or str(e).split(" ", 1)[0]
    script = _SCRIPT_CODE.search(str(e))
    if EXHAUSTED in str(e):
        return True
    return code in TRANSIENT_CODES or (script is not None and script.group(1) in TRANSIENT_CODES)


async def reconnecting(
    call: Callable[[], Awaitable[T]],
    budget_s: float,
    on_lost: Callable[[], None] | None = None,
    probe: Callable[[], Awaitable[object]] | None = None,
) -> T:
    """Run `call` until it gets through, backing off while Redis is unreachable or refusing (restart,
    network, `is_transient` error replies such as OOM).

    Only for idempotent calls: every write of the bus is (owner checks, dedup keys), so a call whose reply
    was lost may run again. Past `budget_s` of failures it raises BusConnectionError; `math.inf` waits out
    any outage, logging `redis_unreachable` every REPORT_EVERY_S. `on_lost` runs after each failure (e.g.
    to re-read state). `probe` (e.g. a PING) tells an outage from a refused request: when the call's
    connection breaks REFUSED_AFTER times in a row and the probe gets through after each, Redis is up and
    refuses this request, and it raises RequestRefused. (Error replies that say "not now" - OOM, LOADING,
    READONLY... - are waited out as before: Redis refuses them to every write for the moment.)
    """
    delay, down_since, reported, refusals = 0.02, 0.0, 0.0, 0
    while True:
        raise_if_cancelled()
        try:
            result = await call()
        except Exception as e:
            if isinstance(e, BusConnectionError) or not is_transient(e):  # (a nested budget ran out)
                raise
            raise_if_cancelled()
            now = time.monotonic()
            down_since = down_since or now
            if on_lost is not None:
                on_lost()
            refusals = refusals + 1 if await _refused(e, probe) else 0
            if refusals >= REFUSED_AFTER:
                log.warning("redis_refused_request", attempts=refusals, error=describe(e))
                raise RequestRefused(
                    f"redis closed the connection on this request {refusals} times in a row while it "
                    f"answered others (a request larger than it accepts?): {e}"
                ) from None
            if now - down_since >= budget_s:
                raise BusConnectionError(f"redis unreachable for {budget_s:.0f}s: {e}") from None
            if now - (reported or down_since) >= REPORT_EVERY_S:
                reported = now
                log.warning("redis_unreachable", down_s=round(now - down_since), error=describe(e))
        else:
            if reported:
                log.info("redis_reachable", down_s=round(time.monotonic() - down_since))
            return result
        await asyncio.sleep(delay * random.uniform(0.5, 1.5))
        delay = min(delay * 2, BACKOFF_CAP_S)


async def _refused(e: Exception, probe: Callable[[], Awaitable[object]] | None) -> bool:
    """Whether the failure `e` of a call was its connection breaking while Redis answers `probe`."""
    if probe is None or not isinstance(e, ConnectionError):
        return False
    try:
        await probe()
    except Exception:
        raise_if_cancelled()
        return False  # Redis is away: an outage
    return True


def raise_if_cancelled() -> None:
    """Re-raise a cancellation that a timeout swallowed.

    Under Python 3.11 a task cancelled while a read's own `asyncio.timeout` fires sees TimeoutError instead
    of CancelledError, and one cancelled just as an `asyncio.wait_for` finished (redis-py sends every
    command through one) sees the result instead; either way its `cancelling()` count stays up. Every
    loop that catches connection errors and goes on calls this first, and every bus call does before it
    runs, so a cancelled worker stops instead of retrying (or reading) forever.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def cancel_and_wait(tasks, timeout_s: float = 10.0) -> None:
    """Cancel `tasks` and wait for them to end, at most `timeout_s`."""
    tasks = [t for t in tasks if not t.done()]
    for t in tasks:
        t.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=timeout_s)

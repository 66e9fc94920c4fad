"""`astraflow health`: whether this host's worker of one role is ready, or alive, judged from Redis.

A probe (Kubernetes exec probe, compose healthcheck, a script) runs it beside the worker, with the
worker's settings (the same recipe and `ASTRAFLOW_...` environment), and reads one line and the exit
status: 0 healthy, 1 not.

Each role is seen through the consumer it holds in its group, whose idle time (since its last read) must
stay below a bound its loop keeps when healthy; a RaaS, whose reads pause while every slot runs a long
episode, through its heartbeat instead:

| role | group it reads | consumer name | also |
|---|---|---|---|
| raas | `prompts` / `raas` | `raas.id`, else `raas-<host>-...` | heartbeat `raas:<id>` |
| dataflow | `rollouts` / `dataflow` | `dataflow.id`, else `dataflow-<host>-...` | |
| trainer | `batches:<model>` / `trainer` | `trainer-<model>` | |

A worker with a default name is found by its host prefix (a pod's hostname is its pod name); the most
recently seen one counts, so a container restarted in place is judged by its new process.

Readiness: Redis answers, the run exists and was not stopped, the worker's consumer was seen within the
bound (and a RaaS's heartbeat is fresh). A RaaS's line also says how its tool calls are sandboxed
(`isolation.mode`: root-namespaces, user-namespaces or none, and whether a RaaS refuses to start for
want of a sandbox: `raas.sandbox`). Liveness (`--live`) judges only the
worker's own signal: when Redis itself is unreachable the worker is not at fault (it waits the outage
out), so the probe passes rather than have every worker restarted during a Redis outage.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

from redis.exceptions import AuthenticationError, AuthorizationError

from astraflow.config import Settings
from astraflow.errors import AstraflowError, BusConnectionError
from astraflow.launch.worker_loop import name_prefix
from astraflow.messages import Heartbeat, decode
from astraflow.ops.context import redis_url, settings_from
from astraflow.streams import Bus
from astraflow.streams.identity import existing
from astraflow.streams.keys import GROUP_DATAFLOW, GROUP_RAAS, GROUP_TRAINER
from astraflow.workflows import isolation
from astraflow.workflows.api import runs_tools

ROLES = ("raas", "dataflow", "trainer")
PROBE_BUDGET_S = 3.0
"""How long the probe waits for an unreachable Redis before it answers."""


class Unhealthy(AstraflowError):
    """The worker is not healthy; the message is the one-line reason."""


@dataclass(frozen=True)
class Target:
    """The consumer that shows one worker: its stream and group, and its name (or a name prefix)."""

    stream: str
    group: str
    name: str
    exact: bool
    max_idle_s: float


def target(settings: Settings, role: str, bus: Bus, name: str | None, model: str | None) -> Target:
    """Where the worker of `role` shows it is alive, and the idle bound its loop keeps when healthy."""
    s = settings.streams
    read_s = (s.block_ms + s.lease_ms) / 1000  # a reader blocks block_ms; one call may wait a lease
    if role == "trainer":
        model = model or settings.trained[0]
        # between reads the trainer runs a step, which the bus lets run handler_timeout_s
        bound = s.handler_timeout_s + read_s
        return Target(bus.keys.batches(model), GROUP_TRAINER, f"trainer-{model}", True, bound)
    if role == "raas":  # a RaaS with every slot busy on long episodes reads nothing: its heartbeat tells
        stream, group, configured, bound = bus.keys.prompts, GROUP_RAAS, settings.raas.id, math.inf
    elif role == "dataflow":
        stream, group, configured, bound = bus.keys.rollouts, GROUP_DATAFLOW, settings.dataflow.id, read_s
    else:
        raise ValueError(f"unknown role: {role!r}")
    chosen = name or configured
    return Target(stream, group, chosen or name_prefix(role), bool(chosen), bound)


async def check(
    bus: Bus, settings: Settings, role: str, *, name=None, model=None, live=False, max_idle_s=None
):
    """The one-line state of the worker; raises Unhealthy with the reason."""
    t = target(settings, role, bus, name, model)
    bound = max_idle_s if max_idle_s is not None else t.max_idle_s
    suffix = ""
    try:
        if not live:
            run = await existing(bus)
            if run is None:
                raise Unhealthy(f"run {settings.run.name!r} does not exist on this Redis (not started yet)")
            if run.stopped is not None:
                raise Unhealthy(f"run {settings.run.name!r} was stopped")
        consumer, idle_s = await _seen(bus, t)
        if idle_s > bound:
            raise Unhealthy(
                f"{consumer} last read {bus.keys.short(t.stream)} {idle_s:.0f}s ago (bound {bound:.0f}s)"
            )
        if role == "raas":
            await _heartbeat(bus, settings, consumer)
            tools = runs_tools(settings.dataflow.feeder.workflow, settings.raas.workflow_options)
            suffix = f"; tool sandbox: {await _sandbox(settings.raas.sandbox, tools)}"
    except BusConnectionError as e:
        if live:
            return f"alive: not judged, {e} (the worker waits Redis out)"
        raise Unhealthy(str(e)) from None
    except (AuthenticationError, AuthorizationError) as e:  # not an outage: the worker cannot use Redis
        raise Unhealthy(f"Redis refused the credentials: {e}") from None
    line = f"{'alive' if live else 'ready'}: {consumer} read {bus.keys.short(t.stream)} {idle_s:.1f}s ago"
    return line + suffix


async def _sandbox(wanted: str, tools: bool) -> str:
    """The mode tool calls run in on this host (the probe runs beside the worker, with its rights), and
    whether the worker refuses to start for want of one (`raas.sandbox`, its workflow running `tools`) or
    refuses each tool call."""
    mode = await asyncio.to_thread(isolation.mode)
    if mode.name == isolation.NONE and wanted != isolation.NONE:
        refused = "a RaaS will not start" if tools else "tool calls are refused"
        return f"{isolation.NONE}, refused ({refused}: raas.sandbox is {wanted}): {mode.reason}"
    return mode.describe()


async def _seen(bus: Bus, t: Target) -> tuple[str, float]:
    """The worker's consumer name and its idle time (s), from XINFO CONSUMERS of its group."""
    import redis.exceptions

    try:
        consumers = await bus.call(lambda: bus.redis.xinfo_consumers(t.stream, t.group))
    except redis.exceptions.NoPermissionError as e:
        raise Unhealthy(f"the probe's Redis user may not read its group: {e}") from None
    except redis.exceptions.ResponseError:  # no such stream or group yet: nobody bootstrapped or read it
        raise Unhealthy(f"no group {t.group!r} on {bus.keys.short(t.stream)} yet") from None
    seen = {_text(c["name"]): int(c["idle"]) / 1000 for c in consumers}
    mine = {n: idle for n, idle in seen.items() if (n == t.name if t.exact else n.startswith(t.name))}
    if not mine:
        who = t.name if t.exact else f"{t.name}*"
        raise Unhealthy(f"no consumer {who} in group {t.group!r} of {bus.keys.short(t.stream)}")
    consumer = min(mine, key=mine.__getitem__)
    return consumer, mine[consumer]


async def _heartbeat(bus: Bus, settings: Settings, wid: str) -> None:
    key = bus.keys.raas(wid)
    fields = await bus.call(lambda: bus.redis.hgetall(key))
    if not fields:
        raise Unhealthy(f"no heartbeat {bus.keys.short(key)} (expired: the worker stopped beating)")
    beat = decode(fields, Heartbeat)
    age, bound = time.time() - beat.updated_at, 3 * settings.raas.heartbeat_ms / 1000
    if age > bound:
        raise Unhealthy(f"heartbeat {bus.keys.short(key)} is {age:.0f}s old (bound {bound:.0f}s)")


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def probe(settings: Settings, url: str, role: str, **kw) -> tuple[bool, str]:
    """(healthy, one line) for `astraflow health`; waits at most PROBE_BUDGET_S (or the shorter
    `redis.reconnect_max_s`) for Redis."""
    budget_s = min(settings.redis.reconnect_max_s, PROBE_BUDGET_S)
    timeout_s = min(settings.redis.socket_timeout_s, budget_s)
    redis = settings.redis.model_copy(update={"reconnect_max_s": budget_s, "socket_timeout_s": timeout_s})
    bus = Bus.connect(url, settings.run.name, redis, settings.streams)
    try:
        return True, await check(bus, settings, role, **kw)
    except Unhealthy as e:
        return False, f"unhealthy: {e}"
    finally:
        await bus.close()


def cmd_health(args) -> int:
    settings = settings_from(args)
    kw = {"name": args.name, "model": args.model, "live": args.live, "max_idle_s": args.max_idle_s}
    healthy, line = asyncio.run(probe(settings, redis_url(settings), args.role, **kw))
    print(line)
    return 0 if healthy else 1

"""Least-privilege Redis ACL grants for one run on a shared Redis: what each role's user may do.

Each user may touch only its run's keys (`af:{RUN}:...`), and each command only on the key families it is
granted for (`GRANTS`: one Redis 7 selector per grant), so the RaaS may trim its input but not `rollouts`.
The project's Lua scripts run as Redis functions that `apply` loads (`functions`), and a role may call
only its own (`ROLE_SCRIPTS`: FCALL of each one's versioned name), never load or run a script of its own.
Functions are no way around the grants: Redis checks every `redis.call` of a function against the caller's
user, and FCALL needs write access to every key a function is handed - which also means a role may send by
hand whatever its functions send (no write is possible "only through a function"). The run identity and
the weight secret are read only to every role: `apply` creates them. docs/security.md's role table is
`role_table()`. The users built from these grants, their passwords and their install are `acl_users`.

What ACLs cannot hide: SCAN is not filtered by key patterns, so a user allowed SCAN (dataflow, observer)
can list the names - not the values - of other runs' keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from astraflow.streams.connection import SCRIPT_NAMES, script_source
from astraflow.streams.keys import Keys

ROLES = ("raas", "dataflow", "trainer", "observer")
WORKERS = ("raas", "dataflow", "trainer")


@dataclass(frozen=True)
class Grant:
    """Commands a role may send on some key families of its run (relative to the run prefix)."""

    what: str
    """What the role does with them (the docs' role table)."""
    families: tuple[str, ...]
    commands: tuple[str, ...]
    write: bool = True
    """False: a read-only key selector (`%R~`), so a write command is refused even where listed."""


_KEYS = Keys("RUN")
OWN = (_KEYS.family("raas"), _KEYS.family("consumer_name", "raas:*"))
"""A RaaS's own keys (its heartbeat, its consumer name): a per-RaaS user (`accounts`) has them for its
id only, so no RaaS can take over another's name or write its heartbeat."""


def _g(what: str, families: str | tuple[str, ...], commands: str, write: bool = True) -> Grant:
    """A grant of `commands` on `families`: names of `Keys` keys and key-building methods (each one's
    family: `ready` -> `ready:*`), or patterns built from them (`_KEYS.family`)."""
    patterns = tuple(_KEYS.family(f) for f in families.split()) if isinstance(families, str) else families
    return Grant(what, patterns, tuple(commands.split()), write)


# Commands without keys every process may send: SELECT for a URL with a database number, transactions,
# TIME, WAIT (replicated writes). No SCRIPT LOAD, EVAL or EVALSHA: a worker runs its functions only.
_BASE = "select multi exec discard time wait".split()
# A consumer of an input stream through the bus's scripts (handoff, claim, renew, release): its group on
# its input, which it may create, and its consumers, which `astraflow health` reads; one that trims it too
# (trim.lua) may remove idle consumers.
_READER = "xreadgroup xack xpending xclaim xrange xinfo|groups xinfo|consumers xgroup|create exists type"
_CONSUMER = _READER + " xgroup|delconsumer xtrim"


_DATAFLOW = ("submit", "submit_eval", "room", "collect", "form", "version", "announce")
_BUS = ("astraflow.streams", None, (*SCRIPT_NAMES, "take_name", "free_name", "beat"))
ROLE_SCRIPTS: dict[str, tuple[tuple[str, str | None, tuple[str, ...]], ...]] = {
    "raas": (_BUS, ("astraflow.weights", None, ("elect", "resign"))),
    "dataflow": (
        _BUS,
        ("astraflow.streams", None, ("strays", "repair")),
        ("astraflow.dataflow", "common.lua", _DATAFLOW),
    ),
    "trainer": (
        _BUS,
        ("astraflow.weights", None, ("manifest",)),
        ("astraflow.dataflow", "common.lua", ("set_aside",)),
    ),
}
"""The scripts each worker role calls, as `connection.register_scripts` takes them (package, prelude file,
names): the functions its user may call (FCALL), loaded by `apply`."""


def role_sources(role: str) -> list[str]:
    """The whole source of each script `role` calls (`connection.script_source`)."""
    scripts = ROLE_SCRIPTS.get(role, ())
    return [script_source(name, pkg, prelude) for pkg, prelude, names in scripts for name in names]


DEDUP = {
    role: tuple(_KEYS.family("dedup", f"{kind}:*") for kind in kinds)
    for role, kinds in {"raas": ("rollout",), "trainer": ("version", "dead")}.items()
}
"""The dedup markers a role's hand-offs write: a RaaS cannot forge a trainer's `version:` marker (which
would keep that version from being announced), nor a trainer a RaaS's, nor a RaaS a dead letter's."""


def _plumbing(role: str, errors: str = "hget hset hdel", run: str = "exists hmget") -> tuple[Grant, ...]:
    """What every worker shares: the stream plumbing the bus's scripts write (errors, dedup markers; but
    for a RaaS, which never dead-letters, `Keys.reaped_streams`: dead letters, the ledger's counts, the
    in-flight set), its own role's consumer names (written only by names.py's ownership-checking scripts),
    the run identity (read only: `create_run.lua` reads it where it exists) and the start checks
    (`runs.open_run`: which of the run's first keys exist)."""
    settles = (
        _g("dead letters", "dead", "xadd xtrim xrange"),
        _g("ledger counts", "ledger", "hincrby"),
        _g("in-flight groups", "in_flight", "srem"),
    )
    return (
        *(settles if role != "raas" else ()),
        _g("entry errors", "errors", errors),
        _g("dedup markers", DEDUP.get(role, "dedup"), "get set"),
        _g(
            "its consumer names (ownership scripts)",
            (_KEYS.family("consumer_name", f"{role}:*"),),
            "get set del",
        ),
        _g("run identity", "identity", run, write=False),
        _g("start checks", "state ledger versions", "exists", write=False),
        # the stop notice: written by the workers that judge the stop conditions, followed by all
        _g("run stop notice", "stop", "hget" if role == "raas" else "hget hset del", role != "raas"),
    )


GRANTS: dict[str, tuple[Grant, ...]] = {
    "raas": (
        _g("prompts (its consumer group; the dataflow trims it)", "prompts", _READER),
        _g("rollouts (hand-off)", "rollouts", "xadd type"),
        _g(
            "its heartbeat (ownership script; `astraflow health` reads it)",
            "raas",
            "hset pexpire del hgetall",
        ),
        *_plumbing("raas", errors="hset hdel"),  # (releases; a hand-off clears them)
        _g("weight manifests", "weights", "hgetall", write=False),
        _g("weight peers", "weight_peers", "zadd zrevrange zrem expire"),
        _g("weight relay election", "weight_relay", "get set del"),
        _g("shared versions (same host, device to device)", "weights_shared", "get", write=False),
        _g("weight-transfer secret", "weights_secret", "get", write=False),
        _g("notices", "notices", "xread xrevrange", write=False),
        _g("published versions", "versions", "xrevrange", write=False),
        _g("run state (versions, notice)", "state", "hmget hget", write=False),
        _g("pushed workflows", "workflows", "hexists hget", write=False),
    ),
    # Coarser than the others: one command set over the dataflow's own families (its scripts touch most)
    "dataflow": (
        _g(
            "the dataflow's streams and state (its scripts)",
            "prompts rollouts versions notices metrics state curator ready replay samples refs formed trace "
            "traces batches scale completed",
            _CONSUMER + " xadd xrevrange xread hget hset hdel hincrby hsetnx hgetall hmget hexists hlen "
            "expire sadd smembers scard zadd zcard zlexcount zrange zrangebylex zrangebyscore zrem "
            "zrevrange zremrangebyrank",
        ),
        _g("lineage records aged out (no stream: it may delete no other key)", "trace", "del"),
        _g(
            "streams with forged ids repaired (repair.lua)",
            "rollouts versions dead",
            "exists xinfo|stream xrange xrevrange xdel xsetid xgroup|setid",
        ),
        _g("in-flight set (feeder, strays)", "in_flight", "sadd smembers scard"),
        _g("ledger (`astraflow scale`)", "ledger", "hgetall hmget hget", write=False),
        _g("live pool: RaaS heartbeats", "raas", "hgetall", write=False),
        _g("heartbeat holders", (OWN[1],), "get", write=False),
        *_plumbing("dataflow", run="exists hmget hget"),
    ),
    "trainer": (
        _g("batches (its consumer group)", "batches", _CONSUMER),
        _g("versions (hand-off)", "versions", "xadd type xrevrange"),
        _g("metrics (and the stop conditions judged from them)", "metrics", "xadd xrange"),
        _g("weight manifests", "weights", "hset hgetall del expire"),
        _g("weight peers", "weight_peers", "del"),
        _g("shared versions (same host, device to device)", "weights_shared", "set"),
        _g("batch samples", "samples", "hmget", write=False),
        _g("run state (newest versions, last notice)", "state", "hmget hget", write=False),
        _g("weight-transfer secret", "weights_secret", "get", write=False),
        *_plumbing("trainer", errors="hget hset hdel hincrby"),
    ),
    # `astraflow top`, `inspect`, `ledger`, `trace`: reads only, every key but the weight secret
    "observer": (
        _g(
            "every key of the run but the weight secret, read only",
            ("[^w]*", _KEYS.family("weights")),  # (a glob over every key whose name starts with no `w`)
            "exists type memory|usage xlen xinfo|groups xpending xrange xrevrange xread hgetall hget hmget "
            "scard zcard",
            write=False,
        ),
    ),
}
# Commands without keys beyond _BASE, by role (SCAN lists key names: never filtered by key patterns).
KEYLESS: dict[str, tuple[str, ...]] = {
    "raas": (),
    "dataflow": ("scan", "info"),
    "trainer": (),
    "observer": ("scan", "info", "multi", "exec", "discard"),
}


def keyless(role: str) -> list[str]:
    """The commands without keys `role` may send (`KEYLESS`, and `_BASE` for every worker), sorted."""
    return sorted({*KEYLESS[role], *([] if role == "observer" else _BASE)})


def script_families(role: str) -> set[str]:
    """The keys `role`'s functions are handed (FCALL needs write access to them; Redis then checks every
    command a function sends against the grants): its writable families and the run identity."""
    # (no script writes the stop notice)
    return families(role, write=True) - {_KEYS.family("stop")} | {_KEYS.family("identity")}


def families(role: str, write: bool | None = None) -> set[str]:
    """The key families `role` may touch (only those it may write, or only read, with `write`)."""
    return {f for g in GRANTS[role] for f in g.families if write is None or g.write == write}


def allowed(role: str) -> set[tuple[str, str]]:
    """Every (command, key family) `role` may send; a keyless command with family ''."""
    base = {(c, "") for c in keyless(role)}
    script = {("fcall", f) for f in script_families(role)} if role in WORKERS else set()
    return base | script | {(c, f) for g in GRANTS[role] for c in g.commands for f in g.families}


TABLE_START, TABLE_END = "<!-- acl-roles:start -->", "<!-- acl-roles:end -->"


def role_table() -> str:
    """The roles' grants as a Markdown table (docs/security.md, between TABLE_START and TABLE_END)."""
    rows = ["| role | for | key families (`af:{RUN}:`...) | commands |", "|---|---|---|---|"]
    cmds = lambda commands: " ".join(commands).replace("|", "\\|")  # noqa: E731 (`xinfo|groups`)
    for role in ROLES:
        for g in GRANTS[role]:
            keys = ", ".join(f"`{f}`" for f in g.families) + ("" if g.write else " (read only)")
            rows.append(f"| {role} | {g.what} | {keys} | {cmds(g.commands)} |")
        if role in WORKERS:
            keys = ", ".join(f"`{f}`" for f in sorted(script_families(role)))
            scripts = ", ".join(n for _, _, names in ROLE_SCRIPTS[role] for n in names)
            what = f"its functions only: {scripts} (each command checked as above)"
            rows.append(f"| {role} | {what} | {keys} | fcall |")
        rows.append(f"| {role} | without keys | - | {cmds(keyless(role))} |")
    return "\n".join(rows)


def write_table(path: Path) -> bool:
    """Replace the role table between the markers of `path` with `role_table()`; whether it changed."""
    text = path.read_text()
    head, rest = text.split(TABLE_START, 1)
    _, tail = rest.split(TABLE_END, 1)
    new = f"{head}{TABLE_START}\n{role_table()}\n{TABLE_END}{tail}"
    path.write_text(new)
    return new != text

"""Least-privilege Redis ACL users for one run on a shared Redis: one user per role.

Each user may touch only its run's keys (`af:{RUN}:...`), and each command only on the key families it is
granted for (`GRANTS`: one Redis 7 selector per grant), so the RaaS may trim its input but not `rollouts`.
Lua scripts are no way around it: Redis checks every `redis.call` of a script against the caller's user,
and EVALSHA needs write access to every key a script declares - which also means a role may send by hand
whatever its scripts send (no write is possible "only through a script"). The run identity and the weight
secret are read only to every role: `apply` creates them. docs/security.md's role table is `role_table()`.

What ACLs cannot hide: SCAN is not filtered by key patterns, so a user allowed SCAN (dataflow, observer)
can list the names - not the values - of other runs' keys.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from astraflow.errors import ConfigError
from astraflow.streams.connection import make_client
from astraflow.streams.identity import provision
from astraflow.streams.keys import Keys

if TYPE_CHECKING:
    from astraflow.config import Settings

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


def _g(what: str, families: str, commands: str, write: bool = True) -> Grant:
    return Grant(what, tuple(families.split()), tuple(commands.split()), write)


# Commands without keys every process may send: SELECT for a URL with a database number, the scripts'
# loading (redis-py reloads a script lost to a restart), transactions, TIME, WAIT (replicated writes).
_BASE = "select script|load script|exists multi exec discard time wait".split()
# A consumer of an input stream through the bus's scripts (handoff, claim, renew, release, trim): its
# group on its input, and only there may it trim, create the group or remove consumers.
_CONSUMER = (
    "xreadgroup xack xpending xclaim xrange xinfo|groups xinfo|consumers xgroup|create xgroup|delconsumer "
    "xtrim exists type"
)


DEDUP = {"raas": "dedup:rollout:* dedup:dead:*", "trainer": "dedup:version:* dedup:dead:*"}
"""The dedup markers a role's hand-offs write: a RaaS cannot forge a trainer's `version:` marker (which
would keep that version from being announced), nor a trainer a RaaS's."""


def _plumbing(role: str, errors: str = "hget hset hdel", run: str = "exists hmget") -> tuple[Grant, ...]:
    """What every worker shares: the stream plumbing the bus's scripts write (dead letters, errors, the
    ledger's counts, the in-flight set, dedup markers), its own role's consumer names (written only by
    names.py's ownership-checking scripts), the run identity (read only: `create_run.lua` reads it where it
    exists) and the start checks (`runs.open_run`: which of the run's first keys exist)."""
    return (
        _g("dead letters", "dead", "xadd xtrim xrange"),
        _g("entry errors", "errors", errors),
        _g("ledger counts", "ledger", "hincrby"),
        _g("in-flight groups", "in_flight", "srem"),
        _g("dedup markers", DEDUP.get(role, "dedup:*"), "get set"),
        _g("its consumer names (ownership scripts)", f"name:{role}:*", "get set del"),
        _g("run identity", "run", run, write=False),
        _g("start checks", "state ledger versions", "exists", write=False),
        # the stop notice: written by the workers that judge the stop conditions, followed by all
        _g("run stop notice", "run:stop", "hget" if role == "raas" else "hget hset del", role != "raas"),
    )


GRANTS: dict[str, tuple[Grant, ...]] = {
    "raas": (
        _g("prompts (its consumer group)", "prompts", _CONSUMER),
        _g("rollouts (hand-off)", "rollouts", "xadd type"),
        _g(
            "its heartbeat (ownership script; `astraflow health` reads it)",
            "raas:*",
            "hset pexpire del hgetall",
        ),
        *_plumbing("raas"),
        _g("weight manifests", "weights:*:*", "hgetall", write=False),
        _g("weight peers", "weights:*:*:peers", "zadd zrevrange zrem expire"),
        _g("weight relay election", "weights:*:*:relay:*", "get set del"),
        _g("shared versions (same host, device to device)", "weights:*:*:shared", "get", write=False),
        _g("weight-transfer secret", "weights:secret", "get", write=False),
        _g("notices", "notices", "xread xrevrange", write=False),
        _g("published versions", "versions", "xrevrange", write=False),
        _g("run state (versions, notice)", "state", "hmget hget", write=False),
        _g("pushed workflows", "workflows", "hexists hget", write=False),
    ),
    # Coarser than the others: one command set over the dataflow's own families (its scripts touch most)
    "dataflow": (
        _g(
            "the dataflow's streams and state (its scripts)",
            "prompts rollouts versions notices metrics state curator:* ready:* replay:* samples:* refs:* "
            "formed:* trace:* traces batches:* scale completed",
            _CONSUMER + " xadd xrevrange xread hget hset hdel hincrby hsetnx hgetall hmget hexists hlen "
            "expire del sadd smembers scard zadd zcard zlexcount zrange zrangebylex zrangebyscore zrem "
            "zrevrange zremrangebyrank",
        ),
        _g("in-flight set (feeder, strays)", "in_flight", "sadd smembers scard"),
        _g("ledger (`astraflow scale`)", "ledger", "hgetall hmget hget", write=False),
        _g("live pool: RaaS heartbeats", "raas:*", "hgetall", write=False),
        _g("heartbeat holders", "name:raas:*", "get", write=False),
        *_plumbing("dataflow", run="exists hmget hget"),
    ),
    "trainer": (
        _g("batches (its consumer group)", "batches:*", _CONSUMER),
        _g("versions (hand-off)", "versions", "xadd type xrevrange"),
        _g("metrics (and the stop conditions judged from them)", "metrics", "xadd xrange"),
        _g("weight manifests", "weights:*:*", "hset hgetall del expire"),
        _g("weight peers", "weights:*:*:peers", "del"),
        _g("shared versions (same host, device to device)", "weights:*:*:shared", "set"),
        _g("batch samples", "samples:*", "hmget", write=False),
        _g("run state (newest versions)", "state", "hmget", write=False),
        _g("weight-transfer secret", "weights:secret", "get", write=False),
        *_plumbing("trainer", errors="hget hset hdel hincrby"),
    ),
    # `astraflow top`, `inspect`, `ledger`, `trace`: reads only, every key but the weight secret
    "observer": (
        _g(
            "every key of the run but the weight secret, read only",
            "[^w]* weights:*:*",
            "type memory|usage xlen xinfo|groups xpending xrange xrevrange xread hgetall hget hmget scard "
            "zcard",
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


def script_families(role: str) -> set[str]:
    """The keys `role`'s scripts declare (EVALSHA needs write access to them; Redis then checks every
    command a script sends against the grants): its writable families and the run identity."""
    return families(role, write=True) - {"run:stop"} | {"run"}  # (no script writes the stop notice)


def families(role: str, write: bool | None = None) -> set[str]:
    """The key families `role` may touch (only those it may write, or only read, with `write`)."""
    return {f for g in GRANTS[role] for f in g.families if write is None or g.write == write}


def allowed(role: str) -> set[tuple[str, str]]:
    """Every (command, key family) `role` may send; a keyless command with family ''."""
    base = {(c, "") for c in (*KEYLESS[role], *([] if role == "observer" else _BASE))}
    script = {("evalsha", f) for f in script_families(role)} if role in WORKERS else set()
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
            rows.append(f"| {role} | its Lua scripts (each command checked as above) | {keys} | evalsha |")
        keyless = sorted({*KEYLESS[role], *([] if role == "observer" else _BASE)})
        rows.append(f"| {role} | without keys | - | {cmds(keyless)} |")
    return "\n".join(rows)


def write_table(path: Path) -> bool:
    """Replace the role table between the markers of `path` with `role_table()`; whether it changed."""
    text = path.read_text()
    head, rest = text.split(TABLE_START, 1)
    _, tail = rest.split(TABLE_END, 1)
    new = f"{head}{TABLE_START}\n{role_table()}\n{TABLE_END}{tail}"
    path.write_text(new)
    return new != text


@dataclass(frozen=True)
class AclUser:
    role: str
    name: str
    rules: tuple[str, ...]
    """ACL SETUSER arguments after the name; the password only as its SHA-256 (`#...`)."""

    def command(self) -> list[str]:
        return ["ACL", "SETUSER", self.name, *self.rules]


def user_name(run: str, role: str) -> str:
    return f"af-{run}-{role}"


def acl_user(run: str, role: str, password: str) -> AclUser:
    """The user of `role` in `run`: reset, then enabled with `password`, its key patterns and commands."""
    if role not in ROLES:
        raise ValueError(f"unknown role: {role!r}")
    prefix = Keys(run).prefix
    keyless = sorted({*KEYLESS[role], *([] if role == "observer" else _BASE)})
    selectors = [_selector(prefix, g.families, g.commands, g.write) for g in GRANTS[role]]
    if role in WORKERS:  # the scripts: Redis checks each command a script sends against the grants above
        selectors.append(_selector(prefix, tuple(sorted(script_families(role))), ("evalsha",), True))
    digest = hashlib.sha256(password.encode()).hexdigest()
    rules = ("reset", "on", f"#{digest}", "resetchannels", *(f"+{c}" for c in keyless), *selectors)
    return AclUser(role, user_name(run, role), rules)


def _selector(prefix: str, families: tuple[str, ...], commands: tuple[str, ...], write: bool) -> str:
    """A Redis 7 selector: `commands` on keys `families` only (read-only keys unless `write`)."""
    mark = "~" if write else "%R~"
    return "(" + " ".join([*(f"{mark}{prefix}{f}" for f in families), *(f"+{c}" for c in commands)]) + ")"


def passwords(path: Path | None) -> tuple[dict[str, str], bool]:
    """The roles' passwords: read from `path` (`role=password` lines) when it exists, else generated (and
    written to `path`, owner-readable only, when given). Returns them and whether they are new."""
    if path is not None and path.exists():
        found = dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)
        missing = [r for r in ROLES if not found.get(r)]
        if missing:
            raise ConfigError(f"{path}: no password for {', '.join(missing)} (lines role=password)")
        return {r: found[r] for r in ROLES}, False
    made = {r: secrets.token_urlsafe(32) for r in ROLES}
    if path is not None:
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write("".join(f"{r}={p}\n" for r, p in made.items()))
    return made, True


def render(users: list[AclUser]) -> str:
    """The users as `redis-cli` lines (passwords appear only hashed)."""
    return "\n".join(" ".join(u.command()) for u in users)


async def apply(client, users: list[AclUser], run: str | None = None) -> None:
    """Install `users` on the Redis behind `client` (an admin connection); re-running replaces them. With
    `run`, create the run's identity and weight secret first (unless they exist; on a primary only): no
    worker user may.
    Selectors and read-only key patterns (`%R~`) need Redis 7: an older server is refused with that
    reason."""
    version = (await client.info("server"))["redis_version"]
    if int(str(version).split(".")[0]) < 7:
        raise ConfigError(f"redis acl needs Redis 7 or newer (read-only key patterns); this one is {version}")
    if run is not None and (await client.info("replication"))["role"] == "master":  # a replica copies it
        await provision(client, Keys(run))
    for u in users:
        await client.execute_command(*u.command())


async def command(settings: Settings, url: str | None, passwords_file: Path | None) -> int:
    """`astraflow redis acl`: print the run's users (and, once, passwords just generated and not written
    to a file); with `url`, install them there."""
    run = settings.run.name
    secrets_, new = passwords(passwords_file)
    users = [acl_user(run, role, secrets_[role]) for role in ROLES]
    print(render(users))
    if new and passwords_file is None:
        print("# passwords (shown once; each worker takes its role's user and password):")
        for role in ROLES:
            print(f"# {user_name(run, role)} {secrets_[role]}")
    elif new:
        print(f"# passwords written to {passwords_file}")
    if url is not None:
        client = make_client(url, settings.redis)
        try:
            await apply(client, users, run)
        finally:
            await client.aclose()
        print(f"# installed {len(users)} users; the run's identity and weight secret are in place")
    return 0

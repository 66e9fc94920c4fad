"""Least-privilege Redis ACL users for one run on a shared Redis: one user per role.

Each user may touch only its run's keys (`af:{RUN}:...`) and, among them, only the families its role
reads or writes, with only the commands its code sends (Lua scripts included: Redis checks every
`redis.call` of a script against the caller's user). The run's weight-transfer secret is readable by the
roles that serve or pull weights (raas, trainer) and by no one else.

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
from astraflow.streams.keys import Keys

if TYPE_CHECKING:
    from astraflow.config import Settings

ROLES = ("raas", "dataflow", "trainer", "observer")

# Commands every process may send: SELECT for a URL with a database number.
_BASE = ["select"]
# What running the bus's Lua scripts takes (redis-py reloads a script lost to a restart with SCRIPT LOAD),
# transactions, and the stream plumbing every consumer shares (the bus's scripts: handoff, renew,
# release, claim, trim).
_WORKER = (
    "evalsha script|load script|exists multi exec discard xreadgroup xgroup|create xack xadd xpending xclaim "
    "xrange xrevrange xinfo|groups xinfo|consumers xgroup|delconsumer xtrim exists type get set srem "
    "hincrby hdel hset hget time wait"
).split()
COMMANDS: dict[str, list[str]] = {
    # heartbeat (hset + pexpire, del), notices (xread), weight manifests and peer sets
    # and the run state's newest published versions (the notice retry), pushed workflows (hexists)
    "raas": [*_WORKER, *"xread pexpire del hgetall hmget hexists zadd zrevrange zrem expire".split()],
    # feeder, collector, batch former, barrier (the dataflow scripts), live pool (SCAN of heartbeats),
    # stranded groups (SMEMBERS of the in-flight set, strays.lua);
    # `astraflow scale` under this user (the ledger's counts, the replication state it reports)
    "dataflow": [
        *_WORKER,
        *"sadd smembers hexists hgetall hmget expire scan zadd zcard zlexcount zrange zrangebylex "
        "zrangebyscore zrem zrevrange del zremrangebyrank scard info".split(),
    ],
    # batches and their samples, the weight manifest it publishes, metrics
    "trainer": [*_WORKER, *"hgetall hmget del expire".split()],
    # `astraflow top`, `inspect`, `ledger`, `trace`: reads only
    "observer": (
        "scan type memory|usage xlen xinfo|groups xpending xrange xrevrange xread hgetall hget hmget scard "
        "zcard multi exec discard info"
    ).split(),
}

# Key families (relative to the run prefix), by role: "rw" read and write, "r" read only.
# ... and what every worker process holds: the run's identity (created by whoever starts first), its name.
_STREAM_PLUMBING = ("dead", "errors", "in_flight", "ledger", "dedup:*", "run", "name:*")
KEYS: dict[str, dict[str, tuple[str, ...]]] = {
    "raas": {
        "rw": (
            "prompts",
            "rollouts",
            *_STREAM_PLUMBING,
            "raas:*",
            "weights:*:*:peers",
            "weights:*:*:relay:*",
            "weights:secret",
        ),
        "r": ("notices", "versions", "weights:*:*", "state", "workflows"),
    },
    "dataflow": {
        "rw": (
            *"prompts rollouts versions notices metrics state curator:* ready:* replay:* samples:* refs:* "
            "formed:* trace:* traces batches:* scale".split(),
            *_STREAM_PLUMBING,
        ),
        "r": ("raas:*",),
    },
    "trainer": {
        "rw": ("batches:*", "versions", "metrics", *_STREAM_PLUMBING, "weights:*:*", "weights:secret"),
        "r": ("state", "samples:*"),
    },
    # every key of the run but the weight secret: `[^w]*` and `weights:*:*` (never `weights:secret`)
    "observer": {"rw": (), "r": ("[^w]*", "weights:*:*")},
}


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
    keys = [f"~{prefix}{k}" for k in KEYS[role]["rw"]] + [f"%R~{prefix}{k}" for k in KEYS[role]["r"]]
    commands = [f"+{c}" for c in sorted({*_BASE, *COMMANDS[role]})]
    digest = hashlib.sha256(password.encode()).hexdigest()
    rules = ("reset", "on", f"#{digest}", "resetchannels", *keys, *commands)
    return AclUser(role, user_name(run, role), rules)


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


async def apply(client, users: list[AclUser]) -> None:
    """Install `users` on the Redis behind `client` (an admin connection); re-running replaces them.
    Read-only key patterns (`%R~`) need Redis 7: an older server is refused with that reason."""
    version = (await client.info("server"))["redis_version"]
    if int(str(version).split(".")[0]) < 7:
        raise ConfigError(f"redis acl needs Redis 7 or newer (read-only key patterns); this one is {version}")
    for u in users:
        await client.execute_command(*u.command())


async def command(settings: Settings, url: str | None, passwords_file: Path | None) -> int:
    """`astraflow redis acl`: print the run's users (and, once, passwords just generated and not written
    to a file); with `url`, install them there."""
    from astraflow.streams.connection import make_client

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
            await apply(client, users)
        finally:
            await client.aclose()
        print(f"# installed {len(users)} users")
    return 0

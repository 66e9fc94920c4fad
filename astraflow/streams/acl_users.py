"""The Redis ACL users of one run, made from the grants of `acl`, and their install.

One user per role (`af-RUN-<role>`), or one per RaaS id (`af-RUN-raas-<id>`, each holding only its own
name and heartbeat); each is reset and then enabled with its password (kept only as its SHA-256 in the
rules), its keyless commands, one selector per grant and one for FCALL of its role's functions.
Passwords are read from a `label=password` file or generated (and written owner-readable only). `apply`
installs the users on an admin connection, loading the functions and creating the run's identity and
weight secret first on a primary, and refuses a Redis older than 7.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from astraflow.errors import ConfigError
from astraflow.streams import functions
from astraflow.streams.acl import GRANTS, OWN, ROLES, WORKERS, keyless, role_sources, script_families
from astraflow.streams.connection import make_client
from astraflow.streams.identity import provision
from astraflow.streams.keys import Keys

if TYPE_CHECKING:
    from astraflow.config import Settings

RAAS_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")


@dataclass(frozen=True)
class AclUser:
    """One user of a run: its label (`role`: a role, or `raas/<id>`), name and ACL rules."""

    role: str
    name: str
    rules: tuple[str, ...]
    """ACL SETUSER arguments after the name; the password only as its SHA-256 (`#...`)."""

    def command(self) -> list[str]:
        return ["ACL", "SETUSER", self.name, *self.rules]


def accounts(raas_ids: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The users to make, by label: one `raas/<id>` per RaaS id (each holds only its own name and
    heartbeat: OWN) where ids are given, else one `raas` user that every RaaS shares; then the others."""
    bad = [i for i in raas_ids if not RAAS_ID.fullmatch(i)]
    if bad:
        raise ConfigError(f"RaaS id {bad[0]!r}: letters, digits, '_', '.' and '-' only (at most 64)")
    return (*(f"raas/{i}" for i in raas_ids), *ROLES[1:]) if raas_ids else ROLES


def user_name(run: str, label: str) -> str:
    """The user of `label` (a role, or `raas/<id>`) in `run`: `af-RUN-raas`, `af-RUN-raas-raas-0`."""
    return f"af-{run}-{label.replace('/', '-')}"


def acl_user(run: str, label: str, password: str) -> AclUser:
    """The user of `label` (a role, or `raas/<id>`: `accounts`) in `run`: reset, then enabled with
    `password`, its key patterns and commands."""
    role, _, worker = label.partition("/")
    if role not in ROLES or (worker and role != "raas"):
        raise ValueError(f"unknown role: {label!r}")
    bind = lambda fs: tuple(f.replace("*", worker) if worker and f in OWN else f for f in fs)  # noqa: E731
    prefix = Keys(run).prefix
    selectors = [_selector(prefix, bind(g.families), g.commands, g.write) for g in GRANTS[role]]
    if role in WORKERS:  # its functions: Redis checks each command one sends against the grants above
        calls = tuple(f"fcall|{functions.function_name(s)}" for s in role_sources(role))
        selectors.append(_selector(prefix, bind(sorted(script_families(role))), calls, True))
    digest = hashlib.sha256(password.encode()).hexdigest()
    rules = ("reset", "on", f"#{digest}", "resetchannels", *(f"+{c}" for c in keyless(role)), *selectors)
    return AclUser(label, user_name(run, label), rules)


def _selector(prefix: str, families: tuple[str, ...], commands: tuple[str, ...], write: bool) -> str:
    """A Redis 7 selector: `commands` on keys `families` only (read-only keys unless `write`)."""
    mark = "~" if write else "%R~"
    return "(" + " ".join([*(f"{mark}{prefix}{f}" for f in families), *(f"+{c}" for c in commands)]) + ")"


def passwords(path: Path | None, labels: tuple[str, ...] = ROLES) -> tuple[dict[str, str], bool]:
    """The users' passwords by label (`accounts`): read from `path` (`label=password` lines) when it
    exists, else generated (and written to `path`, owner-readable only, when given). Returns them and
    whether they are new."""
    if path is not None and path.exists():
        found = dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)
        missing = [r for r in labels if not found.get(r)]
        if missing:
            raise ConfigError(f"{path}: no password for {', '.join(missing)} (lines role=password)")
        return {r: found[r] for r in labels}, False
    made = {r: secrets.token_urlsafe(32) for r in labels}
    if path is not None:
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write("".join(f"{r}={p}\n" for r, p in made.items()))
    return made, True


def render(users: list[AclUser]) -> str:
    """The users as `redis-cli` lines (passwords appear only hashed)."""
    return "\n".join(" ".join(u.command()) for u in users)


async def apply(client, users: list[AclUser], run: str | None = None) -> int:
    """Install `users` on the Redis behind `client` (an admin connection); re-running replaces them. First,
    on a primary (a replica copies them), load the functions of every role (`functions.load`; returns how
    many were new) and with `run` create the run's identity and weight secret (unless they exist): no
    worker user may.
    Selectors and read-only key patterns (`%R~`) need Redis 7: an older server is refused with that
    reason."""
    version = (await client.info("server"))["redis_version"]
    if int(str(version).split(".")[0]) < 7:
        raise ConfigError(f"redis acl needs Redis 7 or newer (read-only key patterns); this one is {version}")
    loaded = 0
    if (await client.info("replication"))["role"] == "master":  # a replica copies them
        loaded = await functions.load(client, [s for role in WORKERS for s in role_sources(role)])
        if run is not None:
            await provision(client, Keys(run))
    if run is not None and any("/" in u.role for u in users):  # per-RaaS users: none shared any more
        await client.execute_command("ACL", "DELUSER", user_name(run, "raas"))
    for u in users:
        await client.execute_command(*u.command())
    return loaded


async def command(
    settings: Settings, url: str | None, passwords_file: Path | None, raas_ids: tuple[str, ...] = ()
) -> int:
    """`astraflow redis acl`: print the run's users (one per RaaS id of `raas_ids`, else one RaaS user;
    and, once, passwords just generated and not written to a file); with `url`, install them there."""
    run = settings.run.name
    labels = accounts(raas_ids)
    secrets_, new = passwords(passwords_file, labels)
    users = [acl_user(run, label, secrets_[label]) for label in labels]
    print(render(users))
    if new and passwords_file is None:
        print("# passwords (shown once; each worker takes its role's user and password):")
        for label in labels:
            print(f"# {user_name(run, label)} {secrets_[label]}")
    elif new:
        print(f"# passwords written to {passwords_file}")
    if url is not None:
        client = make_client(url, settings.redis)
        try:
            loaded = await apply(client, users, run)
        finally:
            await client.aclose()
        print(f"# installed {len(users)} users and {loaded} new functions; the run's identity and weight")
        print("# secret are in place")
    return 0

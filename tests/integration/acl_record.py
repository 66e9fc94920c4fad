"""What each ACL user of a run sends to a test Redis: MONITOR, every command attributed to the user of the
client that sent it (found with CLIENT LIST) and a script's own commands to the script's caller. A client
gone before CLIENT LIST saw it is told by what it sent, when only one role may send all of it."""

from __future__ import annotations

import asyncio
import contextlib
import re
import secrets
from collections import defaultdict
from fnmatch import fnmatchcase

import redis.asyncio as aioredis
import redis.exceptions

from astraflow.streams import acl, acl_users
from astraflow.streams.keys import Keys

# Commands named with their subcommand in ACL rules (`+xgroup|create`).
_CONTAINERS = {
    "xgroup",
    "xinfo",
    "script",
    "memory",
    "client",
    "config",
    "acl",
    "command",
    "object",
    "cluster",
}
_NO_KEYS = {"select", "time", "wait", "multi", "exec", "discard", "info", "scan", "ping"}
_HANDSHAKE = {"auth", "hello"}  # not governed by ACL rules
_LINE = re.compile(r"^[\d.]+ \[\d+ (lua|[\d.:\[\]a-f]+)\] (.*)$")
_ARG = re.compile(r'"((?:[^"\\]|\\.)*)"')


def parse(line: str) -> tuple[str, list[str]] | None:
    """A MONITOR line as (client address or `lua`, args)."""
    m = _LINE.match(line)
    if m is None:
        return None
    return m.group(1), _ARG.findall(m.group(2))


def name_and_keys(args: list[str]) -> tuple[str, list[str]]:
    """The ACL name of a command (`xgroup|create`) and the keys it names."""
    cmd = args[0].lower()
    if cmd in _CONTAINERS and len(args) > 1:
        name = f"{cmd}|{args[1].lower()}"
        keys = args[2:3] if cmd in ("xgroup", "xinfo", "memory", "object") else []
        return name, keys
    if cmd in _NO_KEYS or cmd.startswith("script"):
        return cmd, []
    if cmd in ("evalsha", "eval", "fcall"):
        return cmd, args[3 : 3 + int(args[2])]
    if cmd in ("xread", "xreadgroup"):
        rest = args[[a.lower() for a in args].index("streams") + 1 :]
        return cmd, rest[: len(rest) // 2]
    if cmd in ("del", "unlink", "exists", "touch", "mget"):
        return cmd, args[1:]
    return cmd, args[1:2]


class Recorder:
    """`sent[user]`: the (command, key) pairs each user sent, a key without the run's prefix.

    Addresses are told to users by CLIENT LIST, sent every 20 ms: each answer applies where its CLIENT LIST
    ran in the MONITOR stream (marked by an ECHO in the same MULTI: MONITOR never shows CLIENT), and an AUTH
    there (a new connection, maybe on a port a closed one had) forgets its address until the next answer."""

    def __init__(self, url: str, run: str) -> None:
        self.url, self.run, self.prefix = url, run, Keys(run).prefix
        self.sent: dict[str, set[tuple[str, str]]] = defaultdict(set)
        self.users: dict[str, str] = {}
        self.unknown: dict[str, list[list[str]]] = {}
        self._pending: dict[str, list[list[str]]] = defaultdict(list)
        self._answers: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._done = False

    async def __aenter__(self) -> Recorder:
        self._admin = aioredis.Redis.from_url(self.url, single_connection_client=True)
        self._poller = aioredis.Redis.from_url(self.url)
        self._mark = f"acl-record-{secrets.token_hex(4)}"
        self._monitor = self._admin.monitor()
        await self._monitor.__aenter__()
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._clients())]
        return self

    async def __aexit__(self, *exc) -> None:
        await asyncio.sleep(0.2)
        self._done = True  # both tasks stop: MONITOR read to its end
        for t in self._tasks:
            await t
        for addr, lines in self._pending.items():  # gone before CLIENT LIST saw them (a shutdown's calls)
            sent = [name_and_keys(args) for args in lines if args[0].lower() not in _HANDSHAKE]
            pairs = {(name, k.removeprefix(self.prefix)) for name, keys in sent for k in keys or [""]}
            # told by what they did: the one role allowed to send it all (the ACL LOG shows nothing refused)
            roles = [r for r in acl.ROLES if not beyond(r, pairs)]
            if len(roles) == 1:
                self.sent[acl_users.user_name(self.run, roles[0])] |= pairs
            else:
                self.unknown[addr] = [args[:3] for args in lines]
        with contextlib.suppress(Exception):
            await self._monitor.__aexit__(*exc)
        await self._admin.aclose()
        await self._poller.aclose()

    def _apply(self, answer: list[dict]) -> None:
        self.users = {c["addr"]: c["user"] for c in answer}
        for addr in [a for a in self._pending if a in self.users]:
            for args in self._pending.pop(addr):
                self._record(self.users[addr], args)

    def _record(self, user: str, args: list[str]) -> None:
        if args[0].lower() in _HANDSHAKE:
            return
        name, keys = name_and_keys(args)
        for key in keys or [""]:
            self.sent[user].add((name, key.removeprefix(self.prefix)))

    async def _clients(self) -> None:
        while not self._done:
            async with self._poller.pipeline(transaction=True) as p:  # MONITOR never shows CLIENT LIST
                _, answer = await p.echo(self._mark).client_list().execute()  # the ECHO marks its place
            await self._answers.put(answer)
            await asyncio.sleep(0.02)

    async def _read(self) -> None:
        caller = ""
        while True:
            try:
                raw = await self._monitor.connection.read_response(timeout=0.5)
            except redis.exceptions.TimeoutError:
                raw = None
            if raw is None:  # nothing sent meanwhile
                if self._done:
                    return
                continue
            parsed = parse(raw.decode(errors="replace") if isinstance(raw, bytes) else raw)
            if parsed is None or not parsed[1]:
                continue
            addr, args = parsed
            if args == ["ECHO", self._mark]:
                self._apply(await self._answers.get())
                continue
            if addr != "lua":
                caller = addr
                if args[0].lower() in _HANDSHAKE:
                    self.users.pop(addr, None)
            if caller in self.users:
                self._record(self.users[caller], args)
            else:  # connected since the last CLIENT LIST
                self._pending[caller].append(args)


def _matches(key: str, family: str) -> bool:
    return key == family == "" or (key != "" and family != "" and fnmatchcase(key, family))


def beyond(role: str, sent: set[tuple[str, str]]) -> set[tuple[str, str]]:
    """What `role` sent that its grants do not allow: (command, key)."""
    allowed = acl.allowed(role)
    return {(c, k) for c, k in sent if not any(c == a and _matches(k, f) for a, f in allowed)}


def unused(role: str, sent: set[tuple[str, str]]) -> set[tuple[str, str]]:
    """What `role`'s grants allow that it never sent: (command, key family)."""
    return {(a, f) for a, f in acl.allowed(role) if not any(c == a and _matches(k, f) for c, k in sent)}

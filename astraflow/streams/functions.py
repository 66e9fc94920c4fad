"""The project's Lua scripts as Redis 7 functions, so that no worker may load or run a script of its own.

`astraflow redis acl --apply` (the admin) loads every script as a function (`load`) and grants each role's
user FCALL of its own functions only: no SCRIPT LOAD, EVAL or EVALSHA, so a compromised worker cannot run a
spinning script that blocks the server for everyone. A script's function (and its library) is named by the
digest of the script's whole source (`function_name`): two astraflow versions on one Redis, or a changed
script, never call each other's code, and the ACL names exactly the functions of the version applied.

A `Script` is what `connection.register_scripts` hands out: `await script(keys=..., args=...)`, or queued
on a pipeline. It calls FCALL under a per-role user (a client with a username other than `default`), and
EVALSHA (loading the script on NOSCRIPT) otherwise: on Redis 6.2, the single-password and the embedded
setups, where no `acl --apply` ran. A function missing under a per-role user (a Redis restarted without
persistence, or users installed by another astraflow version) cannot be loaded by the worker: the call
raises `FunctionMissing`, which `connection.reconnecting` waits out like an outage while the log names the
fix (`astraflow redis acl --apply`), so the run goes on once the admin has run it.
"""

from __future__ import annotations

import hashlib
import re

from redis.exceptions import NoPermissionError, NoScriptError, ResponseError

from astraflow.errors import BusError

PREFIX = "af_"
FLAGS = re.compile(r"^-- function flags: ([a-z -]+?)(?: \(|$)", re.MULTILINE)
FIX = "run `astraflow redis acl --apply` as the admin (it loads the functions of this astraflow version)"


class FunctionMissing(BusError):
    """A script's function is not loaded on this Redis, or not granted to this user (another version's
    users): only the admin can load and grant it. Waited out (`connection.is_transient`)."""


def function_name(source: str) -> str:
    """The name of the function (and of its library) that runs script `source`: its SHA-1, as EVALSHA's."""
    return PREFIX + hashlib.sha1(source.encode()).hexdigest()


def library(source: str) -> str:
    """The FUNCTION LOAD code of the library of script `source` (a script written for EVAL: its `KEYS` and
    `ARGV` become the function's arguments), one function named as the library (`function_name`).

    Redis refuses a function at once while it is out of memory, where an EVAL script failed only at its
    first command that may grow memory: a script whose header says `-- function flags: allow-oom` (one that
    frees memory or grows none: trim, renew, ...) is flagged so, and runs then, as it did under EVALSHA."""
    name = function_name(source)
    flags = sorted({f for line in FLAGS.findall(source) for f in line.split()})
    body = f"local function run(KEYS, ARGV)\n{source}\nend\n"
    listed = ", ".join(f"'{f}'" for f in flags)
    register = f"redis.register_function{{function_name='{name}', callback=run, flags={{{listed}}}}}\n"
    return f"#!lua name={name}\n{body}{register}"


async def load(client, sources: list[str]) -> int:
    """Load the function of each of `sources` on the Redis behind `client` (an admin connection), unless
    it is there; returns how many were loaded. Idempotent: a library's name is its source's digest."""
    listed = await client.function_list(library=PREFIX + "*")  # (RESP2: each library a flat list)
    loaded = {dict(zip(lib[::2], lib[1::2], strict=True))[b"library_name"].decode() for lib in listed}
    missing = {function_name(s): s for s in sources if function_name(s) not in loaded}
    for source in missing.values():
        await client.function_load(library(source))
    return len(missing)


def per_role_user(client) -> bool:
    """Whether `client` logs in as a named user (one of `astraflow redis acl`'s): it may call functions
    only."""
    username = client.connection_pool.connection_kwargs.get("username")
    return username not in (None, "", "default")


class Script:
    """A script registered on a client: FCALL of its function under a per-role user, else EVALSHA."""

    def __init__(self, client, source: str) -> None:
        self.client, self.script = client, source
        self.function = function_name(source)
        self.sha = self.function.removeprefix(PREFIX)
        self.functions = per_role_user(client)

    async def __call__(self, keys=(), args=(), client=None):
        """Run the script on `client` (default: the client it was registered on)."""
        client = client or self.client
        try:
            if self.functions:
                return await client.fcall(self.function, len(keys), *keys, *args)
            try:
                return await client.evalsha(self.sha, len(keys), *keys, *args)
            except NoScriptError:
                await self.reload(client)
                return await client.evalsha(self.sha, len(keys), *keys, *args)
        except ResponseError as e:
            missing = self.missing(e)
            if missing is e:
                raise
            raise missing from None

    def queue(self, pipe, keys, args) -> None:
        """Queue the script on `pipe` by its name alone (`connection.with_script` handles a lost one)."""
        if self.functions:
            pipe.fcall(self.function, len(keys), *keys, *args)
        else:
            pipe.evalsha(self.sha, len(keys), *keys, *args)

    async def reload(self, client) -> None:
        """Load the script again after a NOSCRIPT (EVALSHA only: FCALL users cannot load anything)."""
        await client.script_load(self.script)

    def missing(self, e: ResponseError) -> ResponseError:
        """`e` as FunctionMissing when it says the function is not loaded or not granted, else `e`."""
        if not self.functions:
            return e
        text = str(e)
        if "Function not found" in text or (isinstance(e, NoPermissionError) and "'fcall" in text):
            return FunctionMissing(f"redis function {self.function} of this astraflow version: {text}; {FIX}")
        return e

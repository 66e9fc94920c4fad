"""The scripts as Redis functions: named by their source's digest, every shipped script callable by some
role, FCALL only for a per-role user."""

from importlib import resources

import redis.asyncio as aioredis

from astraflow.streams import acl, acl_users
from astraflow.streams.connection import script_source
from astraflow.streams.functions import PREFIX, FunctionMissing, Script, function_name, library


def test_a_function_is_named_by_its_source_so_a_changed_script_is_another_function():
    source = script_source("renew")
    assert function_name(source) == function_name(script_source("renew"))
    assert function_name(source + "\n-- changed") != function_name(source)
    assert function_name(source).startswith(PREFIX)
    code = library(source)
    assert code.startswith(f"#!lua name={function_name(source)}\n")
    name = function_name(source)
    assert f"redis.register_function{{function_name='{name}', callback=run, flags={{'allow-oom'}}}}" in code
    assert "flags={}" in library(
        script_source("handoff")
    )  # (it may grow memory: refused while Redis is full)


def test_every_shipped_script_is_some_roles_function():
    shipped = {
        (pkg, f.name.removesuffix(".lua"))
        for pkg in ("astraflow.streams", "astraflow.dataflow", "astraflow.weights")
        for f in (resources.files(pkg) / "lua").iterdir()
        if f.name.endswith(".lua") and f.name != "common.lua"
    }
    granted = {(pkg, n) for role in acl.WORKERS for pkg, _, names in acl.ROLE_SCRIPTS[role] for n in names}
    assert shipped == granted
    for role in acl.WORKERS:  # each granted by its digest, nothing else may run a script
        rules = " ".join(acl_users.acl_user("r", role, "pw").rules)
        assert all(f"+fcall|{function_name(s)}" in rules for s in acl.role_sources(role))
        assert not {"+evalsha", "+eval", "+script|load", "+function|load"} & set(
            rules.replace(")", " ").split()
        )


def test_only_a_per_role_user_calls_functions():
    def script(url: str) -> Script:
        return Script(aioredis.Redis.from_url(url), "return 1")

    assert script("redis://af-r-raas:pw@127.0.0.1:1").functions
    assert not script("redis://127.0.0.1:1").functions  # one password, the embedded Redis, 6.2: EVALSHA
    assert not script("redis://default:pw@127.0.0.1:1").functions
    assert not script("redis://:pw@127.0.0.1:1").functions


def test_a_missing_or_ungranted_function_is_waited_out_with_the_fix_and_nothing_else_is():
    from redis.exceptions import NoPermissionError, ResponseError

    from astraflow.streams.connection import is_transient

    fcall = Script(aioredis.Redis.from_url("redis://af-r-raas:pw@127.0.0.1:1"), "return 1")
    for e in (
        ResponseError("Function not found"),
        NoPermissionError("no permissions to run the 'fcall' command"),
    ):
        missing = fcall.missing(e)
        assert isinstance(missing, FunctionMissing) and "astraflow redis acl --apply" in str(missing)
        assert is_transient(missing)
    key = NoPermissionError("No permissions to access a key")
    assert fcall.missing(key) is key and not is_transient(key)  # a grant it lacks: fatal, as before
    evalsha = Script(aioredis.Redis.from_url("redis://127.0.0.1:1"), "return 1")
    other = ResponseError("Function not found")
    assert evalsha.missing(other) is other

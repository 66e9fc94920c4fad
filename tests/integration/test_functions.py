"""The project's scripts as Redis 7 functions under `astraflow redis acl` users: no role loads or runs a
script of its own (a spinning one would block the server for everyone), each calls only its own functions,
and functions lost to a restart are waited for until the admin applies them again."""

from __future__ import annotations

import asyncio
from functools import partial

import pytest
import redis.asyncio as aioredis

from astraflow.errors import BusConnectionError
from astraflow.streams import acl, acl_users
from astraflow.streams.connection import register_scripts
from astraflow.streams.functions import FunctionMissing, Script
from astraflow.streams.keys import Keys
from astraflow.streams.names import hold_name
from astraflow.streams.trim import trim
from tests.integration.test_acl import RUN, admin, as_role, connect, install, refused, run_settings, server

pytestmark = pytest.mark.integration
__all__ = ["admin", "server"]  # (fixtures)

SPIN = "while true do end"
_OWN = {  # a script each worker role calls, and one of another role's (refused: not its function)
    "raas": (("astraflow.weights", None, "elect"), ("astraflow.weights", None, "manifest")),
    "dataflow": (("astraflow.dataflow", "common.lua", "form"), ("astraflow.weights", None, "manifest")),
    "trainer": (("astraflow.weights", None, "manifest"), ("astraflow.dataflow", "common.lua", "form")),
}


@pytest.mark.parametrize("role", acl.ROLES)
async def test_no_role_may_load_or_run_a_script_of_its_own(admin, server, role, tmp_path):
    passwords = await install(admin, RUN)
    bus = connect(
        server.display_url,
        as_role(run_settings(server.display_url, "-", tmp_path), RUN, role, passwords[role]),
    )
    attacks = [
        ("EVAL", SPIN, 0),
        ("EVAL_RO", SPIN, 0),
        ("SCRIPT", "LOAD", SPIN),
        ("EVALSHA", "0" * 40, 0),
        ("FUNCTION", "LOAD", f"#!lua name=spin\nredis.register_function('spin', function() {SPIN} end)"),
        ("FUNCTION", "FLUSH"),
        ("FUNCTION", "DELETE", "x"),
        ("SCRIPT", "FLUSH"),
    ]
    try:
        assert [await refused(partial(bus.redis.execute_command, *a)) for a in attacks] == [True] * 8
        if role in acl.WORKERS:  # its own functions run (FCALL), another role's are not granted
            async with hold_name(bus, "w-0", role=role):  # the bus's own scripts, as every worker's
                assert await admin.get(Keys(RUN).consumer_name(f"{role}:w-0")) is not None
            own, other = _OWN[role]
            script = register_scripts(bus.redis, own[0], (own[2],), prelude=own[1])[own[2]]
            assert script.functions and script.function in acl_users.acl_user(RUN, role, "-").rules[-1]
            foreign = register_scripts(bus.redis, other[0], (other[2],), prelude=other[1])[other[2]]
            with pytest.raises(FunctionMissing, match="acl --apply"):
                await foreign(keys=[Keys(RUN).prefix + "x"], args=[])
    finally:
        await bus.close()
    assert await admin.function_list(library="spin") == []


async def test_functions_lost_to_a_restart_are_waited_for_until_the_admin_applies_them(
    admin, server, tmp_path
):
    passwords = await install(admin, RUN)
    settings = as_role(run_settings(server.display_url, "-", tmp_path), RUN, "raas", passwords["raas"])
    bus = connect(server.display_url, settings)
    try:
        await admin.xgroup_create(bus.keys.prompts, "g", mkstream=True)
        await admin.function_flush()  # what a restart without persistence leaves
        bus.reconnect_max_s = 0.5
        with pytest.raises(BusConnectionError, match="astraflow redis acl --apply"):
            await bus.renew(bus.keys.prompts, "g", "raas-0", ["1-0"])
        bus.reconnect_max_s = 60
        waiting = asyncio.create_task(bus.renew(bus.keys.prompts, "g", "raas-0", ["1-0"]))
        await asyncio.sleep(0.3)
        assert not waiting.done()  # waits for the functions ...
        await install(admin, RUN)  # ... which the admin loads again
        assert await asyncio.wait_for(waiting, 30) == ["1-0"]  # (not its entry: reported lost)
    finally:
        await bus.close()


async def test_a_changed_script_never_runs_the_loaded_version(admin, server):
    """Two astraflow versions on one Redis: a script whose source differs is another function."""
    passwords = await install(admin, RUN)

    raas = aioredis.Redis.from_url(
        server.display_url, username=acl_users.user_name(RUN, "raas"), password=passwords["raas"]
    )
    try:
        loaded = register_scripts(raas, "astraflow.weights", ("resign",))["resign"]
        changed = Script(raas, loaded.script + "\n-- the next version")
        key = Keys(RUN).weight_relay("policy", 1, "incarnation", "region", "seat")
        assert await loaded(keys=[key], args=["me"]) == 0  # runs: granted and loaded
        with pytest.raises(FunctionMissing, match="acl --apply"):
            await changed(keys=[key], args=["me"])
    finally:
        await raas.aclose()


async def test_while_redis_is_full_the_functions_that_free_memory_still_run(admin, server, tmp_path):
    """Redis refuses a function at once while out of memory (an EVAL script only at its first write that
    may grow memory): trimming and lease renewals must run then, as they did, and nothing else may."""
    from astraflow.streams.connection import is_transient

    passwords = await install(admin, RUN)
    settings = as_role(run_settings(server.display_url, "-", tmp_path), RUN, "trainer", passwords["trainer"])
    bus = connect(server.display_url, settings)
    stream = bus.keys.batches("policy")
    await admin.xgroup_create(stream, "trainer", mkstream=True)
    await admin.xadd(stream, {"kind": "x"})
    await admin.config_set("maxmemory", 1)
    try:
        bus.reconnect_max_s = 0.5
        assert await bus.renew(stream, "trainer", "t-0", ["1-0"]) == ["1-0"]  # (runs: not its entry)
        assert await trim(bus, stream) == 0
        take = register_scripts(bus.redis, names=("take_name",))["take_name"]
        with pytest.raises(Exception, match="maxmemory") as refused_:
            await take(keys=[bus.keys.consumer_name("trainer:t-0")], args=["me", 1000, "me"])
        assert is_transient(refused_.value)  # waited out, as a write refused for memory always was
    finally:
        await admin.config_set("maxmemory", 0)
        await bus.close()

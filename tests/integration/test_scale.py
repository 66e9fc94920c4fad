"""`astraflow scale` against a real Redis: the exporter a KEDA `prometheus` scaler reads, and the figure from
a real RaaS worker's heartbeats."""

import asyncio
import subprocess
import sys
import time
import urllib.request

import pytest

from astraflow import redis_server
from astraflow.cli import main
from astraflow.messages import Heartbeat, decode, encode
from astraflow.streams import Bus
from astraflow.streams.records import TrainerStep, encode_record
from tests.integration.raas_helpers import raas_settings, rollouts, spawn_raas, stop, submit, wait_for


async def trainer_steps(bus, samples: int, step_s: float, wait_s: float, n: int = 5) -> None:
    """What a trainer taking `samples` per `step_s`, waiting `wait_s` for each batch, writes to `metrics`."""
    for v in range(1, n + 1):
        stats = {"samples": samples, "step_s": step_s, "wait_s": wait_s}
        step = TrainerStep("policy", v, f"b{v}", 100.0 + v * (step_s + wait_s), stats)
        await bus.redis.xadd(bus.keys.metrics, encode_record(step))


def heartbeat(uid: str, groups: int, generating_s: float, started_at: float) -> Heartbeat:
    return Heartbeat(
        uid=uid, region="local", capacity=8, in_flight=8, versions={"policy": 1}, endpoint=None,
        started_at=started_at, updated_at=time.time(), generating_s=generating_s, groups=groups,
    )  # fmt: skip


async def pulse(bus, rates: dict[str, int]) -> None:
    """Workers beating every 0.1 s, each beat one more second of generating and `rates[uid]` more groups
    (`rates` may grow: a worker joins)."""
    ticks: dict[str, int] = {}
    started = {}
    while True:
        for uid, rate in list(rates.items()):
            ticks[uid] = ticks.get(uid, 0) + 1
            hb = heartbeat(uid, rate * ticks[uid], float(ticks[uid]), started.setdefault(uid, time.time()))
            await bus.redis.hset(bus.keys.raas(uid), mapping=encode(hb))
        await asyncio.sleep(0.1)


def scrape(port: int) -> dict[str, float]:
    """The exporter's `astraflow_*` samples (name with labels -> value)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    pairs = (line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("astraflow_"))
    return {name: float(value) for name, value in pairs}


async def until_gauge(port: int, proc, name: str, value: float) -> dict[str, float]:
    async def seen() -> bool:
        assert proc.poll() is None, "the exporter exited"
        try:
            return scrape(port).get(name) == value
        except OSError:  # not listening yet
            return False

    await wait_for(seen, 30, f"{name} = {value}")
    return scrape(port)


async def test_exporter_serves_the_needed_workers_and_follows_the_pool(bus, redis_url, tmp_path):
    """A trainer that could take 64 samples/s (groups of 8: 8 groups/s) fed by two workers making 1 group/s
    each while generating: 10 workers with headroom 1.25. A third worker joins making 4 groups/s: the mean
    worker makes 2 groups/s, so 5 are needed; the gauge and the `scale` hash follow."""
    await trainer_steps(bus, 64, 1.0, 3.0)
    rates = {"a": 1, "b": 1}
    beating = asyncio.create_task(pulse(bus, rates))
    url_file = tmp_path / "redis-url"
    url_file.write_text(redis_url)
    port = redis_server.free_port()
    cmd = [sys.executable, "-m", "astraflow.cli", "scale", "--run", "it", "--redis-file", str(url_file)]
    cmd += ["--serve", str(port), "--bind", "127.0.0.1", "--interval", "0.2", "--headroom", "1.25"]
    log = open(tmp_path / "scale.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    try:
        needed = 'astraflow_raas_needed{run="it"}'
        got = await until_gauge(port, proc, needed, 10.0)
        assert got['astraflow_raas_workers{run="it"}'] == 2.0
        assert got['astraflow_raas_demand_groups_per_second{run="it"}'] == 8.0
        assert got['astraflow_raas_worker_groups_per_second{run="it"}'] == 1.0
        assert (await bus.redis.hget(bus.keys.scale, "needed")) == b"10"
        rates["c"] = 4
        got = await until_gauge(port, proc, needed, 5.0)
        assert got['astraflow_raas_workers{run="it"}'] == 3.0
        assert (await bus.redis.hget(bus.keys.scale, "needed")) == b"5"
    finally:
        beating.cancel()
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.slow
async def test_a_real_worker_reports_its_production(bus, redis_url, tiny_model, tmp_path, capsys):
    """A real RaaS worker rolls out 6 groups; its heartbeat counts them, and `astraflow scale` prints the
    worker's rate and the workers a trainer taking 32 samples/s (16 groups/s of 2) would need."""
    s = raas_settings(redis_url, tiny_model, tmp_path, "raas-0", slots=6)
    worker = spawn_raas(s)
    try:
        await submit(bus, 6)
        await wait_for(lambda: _count(bus, 6), 60, "6 rollout groups")

        async def counted() -> bool:
            fields = await bus.redis.hgetall(bus.keys.raas("raas-0"))
            return bool(fields) and decode(fields, Heartbeat).groups == 6

        await wait_for(counted, 10, "the heartbeat to count 6 groups")
        await trainer_steps(bus, 32, 1.0, 0.0)
        url_file = tmp_path / "redis-url"
        url_file.write_text(redis_url)
        capsys.readouterr()
        cmd = ["scale", "--run", "it", "--redis-file", str(url_file), "--set", "dataflow.feeder.n_samples=2"]
        assert await asyncio.to_thread(main, cmd) == 0
        out = capsys.readouterr().out
        hb = decode(await bus.redis.hgetall(bus.keys.raas("raas-0")), Heartbeat)
        rate = 6 / hb.generating_s
        assert f"{rate:.2f} groups/s while generating" in out
        assert "16.00 groups/s needed" in out
        needed = int((await bus.redis.hget(bus.keys.scale, "needed")).decode())
        assert abs(needed - 16 * 1.2 / rate) <= 1, out
    finally:
        stop(worker)


async def _count(bus, n: int) -> bool:
    return len(await rollouts(bus)) >= n


@pytest.mark.parametrize("role", ["observer", "dataflow"])
async def test_under_an_acl_user_the_plan_is_written_only_by_a_writing_role(
    bus, redis_instance, tmp_path, capsys, role
):
    """The observer ACL user (what `top` and `inspect` run as) may not write: `astraflow scale` still
    prints the plan, says the hash was not written, and leaves Redis as it was. The dataflow's user (what
    the Kubernetes scaler runs as) writes it."""
    from astraflow.streams import acl_users

    if int((await bus.redis.info("server"))["redis_version"].split(".")[0]) < 7:
        pytest.skip("ACL key selectors need Redis 7")
    await trainer_steps(bus, 64, 1.0, 3.0)
    await bus.redis.hset(bus.keys.raas("a"), mapping=encode(heartbeat("a", 100, 100.0, time.time() - 100)))
    user = acl_users.acl_user("it", role, "role-pw")
    await bus.redis.execute_command(*user.command())
    try:
        url_file = tmp_path / "role-url"
        url_file.write_text(f"redis://{user.name}:role-pw@127.0.0.1:{redis_instance.port}/0")
        capsys.readouterr()
        cmd = ["scale", "--run", "it", "--redis-file", str(url_file), "--headroom", "1.25"]
        assert await asyncio.to_thread(main, cmd) == 0
        out = capsys.readouterr().out
        assert [line.split()[-1] for line in out.splitlines() if line.startswith("needed")] == ["10"]
        writes = role != "observer"
        assert ("may not write it" in out) != writes
        assert await bus.redis.exists(bus.keys.scale) == writes
    finally:
        await bus.redis.execute_command("ACL", "DELUSER", user.name)


@pytest.mark.slow
async def test_the_exporter_waits_out_a_redis_restart(tmp_path, redis_settings, streams_settings):
    """Redis killed under the exporter: it keeps serving the last figure and stays up; once Redis is back
    (AOF) it follows the pool again."""
    server = redis_server.start(tmp_path / "redis", appendfsync="always")
    bus = Bus.connect(server.url, "it", redis_settings, streams_settings)
    await trainer_steps(bus, 64, 1.0, 3.0)
    rates = {"a": 1, "b": 1}
    beating = asyncio.create_task(pulse(bus, rates))
    url_file = tmp_path / "redis-url"
    url_file.write_text(server.url)
    port = redis_server.free_port()
    cmd = [sys.executable, "-m", "astraflow.cli", "scale", "--run", "it", "--redis-file", str(url_file)]
    cmd += ["--serve", str(port), "--bind", "127.0.0.1", "--interval", "0.2", "--headroom", "1.25"]
    log = open(tmp_path / "scale.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    needed = 'astraflow_raas_needed{run="it"}'
    try:
        await until_gauge(port, proc, needed, 10.0)
        beating.cancel()
        server.kill()
        await asyncio.sleep(3)
        assert proc.poll() is None, (tmp_path / "scale.log").read_text()[-2000:]
        assert scrape(port)[needed] == 10.0
        server = redis_server.start(
            tmp_path / "redis", port=server.port, password=server.password, appendfsync="always"
        )
        rates["c"] = 4
        beating = asyncio.create_task(pulse(bus, rates))
        await until_gauge(port, proc, needed, 5.0)
        assert b"scale_read_failed" in (tmp_path / "scale.log").read_bytes()
    finally:
        beating.cancel()
        proc.terminate()
        proc.wait(timeout=10)
        await bus.close()
        server.stop()

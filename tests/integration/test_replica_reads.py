"""A RaaS-side bus with `redis.replica_url` against a real primary and a real replica (`REPLICAOF`): notices,
manifests and peer lists are read off the replica (counted), a manifest the lagging replica lacks is read
from the primary, and once the replica is killed (-9) every read falls back to the primary."""

from __future__ import annotations

import pytest
import torch

from astraflow import redis_server
from astraflow.ops.inspect import report
from astraflow.streams import Bus, Out
from astraflow.streams.replica import replica_lag
from astraflow.streams.settings import RedisSettings, StreamsSettings
from astraflow.weights.settings import WeightsSettings
from tests.integration.replicas import attach, client, kill9, start_replica, system_redis
from tests.integration.test_weights import publish, receiver, step, trainer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


@pytest.fixture
def primary(tmp_path):
    server = redis_server.start(tmp_path / "primary", binary=system_redis(), appendfsync="always")
    yield server
    server.stop()


@pytest.fixture
def replica(tmp_path, primary):
    server = start_replica(tmp_path / "replica", primary)
    yield server
    if server.alive():
        server.stop()


def replicated(primary) -> None:
    c = client(primary)
    assert c.wait(1, 5000) == 1
    c.close()


async def read_notices(bus: Bus) -> list:
    notices = {bus.keys.notices: "0-0"}
    reply = await bus.read_only(lambda r: r.xread(notices, count=10, block=100), blocking=True)
    return reply[0][1] if reply else []


async def test_reads_go_to_the_replica_and_fall_back_to_the_primary(tmp_path, primary, replica):
    streams = StreamsSettings(block_ms=200)
    central = Bus.connect(primary.url, "it", RedisSettings(), streams)
    regional = Bus.connect(primary.url, "it", RedisSettings(replica_url=replica.url), streams)
    settings = WeightsSettings(full_every=100, same_host=False)  # region b: another host, pulls over TCP
    pub, state, secret = await trainer(central, settings, tmp_path / "trainer")
    rx = receiver(regional, settings, secret, tmp_path, "rx")
    try:
        # In sync: the notice, the manifest and the peer list come off the replica.
        key = await publish(pub, state, 0)
        await central.publish(Out(central.keys.notices, {"kind": "notice", "version": "0"}))
        replicated(primary)
        assert [f[b"version"] for _, f in await read_notices(regional)] == [b"0"]
        await rx.sync(key, 0)
        assert regional.reader.stats["replica"] >= 3 and regional.reader.stats["fallback"] == 0
        [(address, lag)] = await replica_lag(central.redis)  # (acknowledged once a second: may lag a little)
        assert address == f"127.0.0.1:{replica.port}" and lag >= 0
        assert f"replicas: 127.0.0.1:{replica.port} lag " in await report(central)  # `astraflow inspect`

        # Lagging: the replica lost its link (it serves what it has); v1's manifest is read from the primary.
        attach(replica, redis_server.free_port(), primary.password, wait_s=0)
        step(state, 0.01, 1)
        key = await publish(pub, state, 1)
        assert not await regional.reader.replica.exists(key)
        await rx.sync(key, 1)
        assert rx.held[0] == 1 and regional.reader.stats["behind"] == 1
        attach(replica, primary.port, primary.password)

        # Down: kill -9; every read goes to the primary, the worker notices nothing else.
        kill9(replica)
        step(state, 0.01, 2)
        key = await publish(pub, state, 2)
        await central.publish(Out(central.keys.notices, {"kind": "notice", "version": "2"}))
        await rx.sync(key, 2)
        assert rx.held[0] == 2
        assert [f[b"version"] for _, f in await read_notices(regional)] == [b"0", b"2"]
        assert regional.reader.stats["fallback"] >= 2
        assert "replicas: none" in await report(central)
    finally:
        await pub.close()
        rx.close()
        rx.server.close()
        await regional.close()
        await central.close()


@pytest.mark.slow
async def test_a_raas_worker_follows_the_trainer_off_the_replica(tmp_path, primary, replica, tiny_model):
    """The real worker (hf engine) on a bus with `replica_url`: it follows notices and pulls manifests off
    the replica; after the replica is killed it follows the trainer through the primary."""
    from transformers import AutoModelForCausalLM

    from tests.integration.raas_helpers import wait_for
    from tests.integration.test_weight_follow import Follower, _at, served_equals_engine

    streams = StreamsSettings(block_ms=100)
    central = Bus.connect(primary.url, "it", RedisSettings(), streams)
    regional = Bus.connect(primary.url, "it", RedisSettings(replica_url=replica.url), streams)
    await central.bootstrap(["policy"])
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    pub, _, secret = await trainer(central, WeightsSettings(), tmp_path / "trainer", model.state_dict())
    f = Follower(regional, primary.url, tiny_model, tmp_path, secret)
    await f.start()
    try:
        for version in range(1, 4):
            if version == 3:
                kill9(replica)
            with torch.no_grad():
                next(model.parameters()).add_(0.01)
            await pub.publish(model.state_dict(), version, step=version)
            await pub.wait()
            await wait_for(lambda v=version: _at(f.engine, v), 30, f"engine at version {version}")
            if version == 2:
                assert regional.reader.stats["replica"] > 0 and regional.reader.stats["fallback"] == 0
        assert served_equals_engine(pub, f.engine)
        assert regional.reader.stats["fallback"] > 0
    finally:
        await f.close()
        await pub.close()
        await regional.close()
        await central.close()

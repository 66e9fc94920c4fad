"""Sentinel failover under a stream of hand-offs, on real processes: a primary, two replicas, one Sentinel
(`redis-server CONF --sentinel`). The replicas lose their link while the simulated RaaS hands off, the
primary is killed (-9), and Sentinel promotes a replica; every worker follows it. With
`redis.min_replicas_ack: 1` no hand-off was acknowledged that the promoted replica lacks: no rollout is
acknowledged twice (lost, then redone), one whose read the promoted replica lacks is answered 'lost' (not
'dup', "done"), and the ledger balances with nothing in flight."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
import redis

from astraflow import redis_server
from astraflow.dataflow.ledger import read_ledger
from astraflow.dataflow.service import Dataflow
from astraflow.launch.build import dataflow_setup
from astraflow.settings_load import load_settings
from astraflow.streams import Bus
from astraflow.streams.settings import RedisSettings, StreamsSettings
from tests.dataflow_helpers import heartbeat, roll_out
from tests.integration.replicas import attach, client, kill9, start_replica, start_sentinel, system_redis

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(90)]
NAME = "af"


@pytest.fixture
def cluster(tmp_path):
    """(primary, [replica, replica], sentinel port)."""
    primary = redis_server.start(tmp_path / "primary", binary=system_redis(), appendfsync="always")
    replicas = [start_replica(tmp_path / f"replica{i}", primary) for i in range(2)]
    sentinel, port = start_sentinel(tmp_path / "sentinel", primary, NAME)
    yield primary, replicas, port
    sentinel.kill()
    sentinel.wait()
    for server in (primary, *replicas):
        if server.alive():
            server.stop()


async def promoted(sentinel_port: int, old_port: int) -> int:
    """The port of the primary Sentinel names, once it is not `old_port`."""
    sentinel = redis.Redis(port=sentinel_port)
    for _ in range(300):
        _, port = sentinel.sentinel_get_master_addr_by_name(NAME)
        if port != old_port:
            return port
        await asyncio.sleep(0.1)
    raise AssertionError("no failover")


async def drain(df: Dataflow, bus: Bus, statuses: dict) -> None:
    for _ in range(200):
        await df.feeder.step()
        await roll_out(bus, 100, lambda g, i: float(i % 2), statuses=statuses)
        await df.collector.step(10)
        ledger = await read_ledger(bus, ["policy"])
        if ledger.submitted >= 24 and ledger.in_flight == 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"did not drain: {ledger.render()}")


async def test_acknowledged_handoffs_survive_a_failover(cluster):
    primary, replicas, sentinel_port = cluster
    settings = load_settings(
        None,
        [
            "run.name=it",
            "dataflow.feeder.n_samples=2",
            "dataflow.batch.size=1000",
        ],
    )
    s = RedisSettings(
        sentinels=[f"127.0.0.1:{sentinel_port}"],
        master_name=NAME,
        password=primary.password,
        min_replicas_ack=1,
        replica_ack_timeout_ms=200,
    )
    bus = Bus.connect("", "it", s, StreamsSettings(block_ms=200), wait_out=True)
    statuses: dict[str, list[str]] = {}
    try:
        await bus.bootstrap(["policy"])
        direct = client(primary)
        assert direct.wait(2, 5000) == 2  # (so that the replica Sentinel names surely has the identity)
        direct.close()
        identity = await bus.read_only(lambda c: c.hgetall(bus.keys.identity), fresh=bool)
        assert identity and bus.reader.stats == {"replica": 1}  # off a replica Sentinel named
        df = Dataflow(dataflow_setup(settings), bus, "df")
        await heartbeat(bus, "sim", 8)
        await df.feeder.step()
        assert await roll_out(bus, 4, lambda g, i: float(i % 2), statuses=statuses)
        await df.feeder.step()

        # The replicas stop taking the stream (their link breaks); a hand-off goes to the primary, which
        # then dies; the replicas point at it again (a link that is down) and Sentinel promotes one.
        for r in replicas:
            attach(r, redis_server.free_port(), primary.password, wait_s=0)
        handing_off = asyncio.create_task(roll_out(bus, 4, lambda g, i: 1.0, statuses=statuses))
        await asyncio.sleep(0.6)
        assert not handing_off.done()  # not acknowledged: no replica has it
        kill9(primary)
        for r in replicas:
            attach(r, primary.port, primary.password, wait_s=0)
        lost = await handing_off  # ... on the promoted replica, which never delivered them: 'lost'
        assert [statuses[uid] for uid in lost] == [["lost"]] * 4
        assert await promoted(sentinel_port, primary.port) in {r.port for r in replicas}

        await drain(df, bus, statuses)
        ledger = await read_ledger(bus, ["policy"])
        assert not ledger.problems(), ledger.render()
        assert ledger.failover_offset is not None and "failover:" in ledger.render()  # (said, not hidden)
        assert ledger.collected == ledger.submitted and ledger.dead == 0
        # Each rollout handed off exactly once: none acknowledged, lost and redone. ('dup' is one too: a
        # retry's answer when the script ran but WAIT timed out, as it may while the other replica follows.)
        twice = {uid: st for uid, st in statuses.items() if len([s for s in st if s != "lost"]) != 1}
        assert not twice, twice
        written = Counter(f[b"uid"].decode() for _, f in await bus.redis.xrange(bus.keys.rollouts))
        assert written == Counter(set(statuses))
    finally:
        await bus.close()

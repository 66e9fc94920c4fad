"""`astraflow scale`: the RaaS workers a run needs, from synthetic trainer metrics and heartbeats."""

from astraflow.config import Settings
from astraflow.messages import Heartbeat, encode
from astraflow.ops.scale_plan import (
    Demand,
    Pool,
    plan,
    pool_rates,
    read_plan,
    render,
    trainer_rates,
    write_plan,
)
from astraflow.streams.records import RolloutStats, TrainerStep, encode_record


def beat(uid: str, groups: int, generating_s: float, up_s: float = 100.0) -> Heartbeat:
    return Heartbeat(
        uid=uid, region="local", capacity=8, in_flight=8, versions={"policy": 3}, endpoint=None,
        started_at=1000.0, updated_at=1000.0 + up_s, generating_s=generating_s, groups=groups,
    )  # fmt: skip


async def feed(bus, steps: int, samples: int, step_s: float, wait_s: float, beats: list[Heartbeat]):
    """A trainer that steps every `step_s + wait_s` seconds on `samples`, groups of 8 collected, and the
    pool's heartbeats."""
    t = 5000.0
    for v in range(1, steps + 1):
        t += step_s + wait_s
        stats = {"samples": samples, "step_s": step_s, "wait_s": wait_s}
        await bus.redis.xadd(bus.keys.metrics, encode_record(TrainerStep("policy", v, f"b{v}", t, stats)))
        await bus.redis.xadd(bus.keys.metrics, encode_record(RolloutStats("policy", 4, 32, 1.0, t)))
    for hb in beats:
        await bus.redis.hset(bus.keys.raas(hb.uid), mapping=encode(hb))


async def test_a_starved_trainer_asks_for_more_workers(bus):
    """The trainer waits 3 s for every 1 s step: it consumes 16 samples/s but could take 64 (8 groups/s);
    two workers make 1 group/s each while generating: with headroom 1.25, 10 workers."""
    await feed(bus, 10, 64, 1.0, 3.0, [beat("a", 100, 100.0), beat("b", 50, 50.0)])
    p, beats = await read_plan(bus, Settings(), headroom=1.25)
    assert len(beats) == 2
    (d,) = p.demands
    assert abs(d.consumed_samples_per_s - 16.0) < 1e-6
    assert abs(d.capacity_samples_per_s - 64.0) < 1e-6
    assert d.samples_per_group == 8.0
    assert p.pool.workers == 2
    assert abs(p.pool.per_worker_groups_per_s - 1.0) < 1e-9
    assert p.needed == 10
    text = render(p, "t")
    for expected in ("16.0 samples/s consumed", "64.0 when fed", "1.00 groups/s while generating", "10"):
        assert expected in text, expected
    await write_plan(bus, p)
    stored = await bus.redis.hgetall(bus.keys.scale)
    assert stored[b"needed"] == b"10" and stored[b"workers"] == b"2"
    assert bus.keys.scale == "af:{t}:scale"


async def test_drops_and_replay_change_the_demand(bus):
    """Half of the collected groups are dropped (x2), a quarter of each batch is replay (x0.75)."""
    await feed(bus, 5, 64, 1.0, 0.0, [beat("a", 100, 100.0)])
    await bus.redis.hset(bus.keys.ledger, mapping={"policy:trained": 10, "policy:dropped:stale": 10})
    s = Settings()
    s.dataflow.batch.replay_ratio = 0.25
    p, _ = await read_plan(bus, s, headroom=1.0)
    (d,) = p.demands
    assert d.kept == 0.5 and d.fresh == 0.75
    assert abs(d.groups_per_s - 64 * 0.75 / 8 / 0.5) < 1e-9  # 12 groups/s
    assert p.needed == 12


async def test_no_evidence_keeps_the_pool(bus):
    await feed(bus, 3, 64, 1.0, 0.0, [])
    p, _ = await read_plan(bus, Settings())
    assert p.needed == 1 and "no RaaS worker alive" in p.reason
    await bus.redis.delete(bus.keys.metrics)
    for hb in (beat("a", 0, 0.0), beat("b", 0, 0.0)):
        await bus.redis.hset(bus.keys.raas(hb.uid), mapping=encode(hb))
    p, _ = await read_plan(bus, Settings())
    assert p.needed == 2 and "no trainer step" in p.reason
    await feed(bus, 3, 64, 1.0, 0.0, [])
    p, _ = await read_plan(bus, Settings())
    assert p.needed == 2 and "no RaaS production" in p.reason


def test_production_over_a_window():
    """Against earlier beats, only what happened since counts: a worker that sped up is seen at its new
    rate; a worker that joined since counts from its start."""
    old = beat("a", 100, 100.0)
    now = beat("a", 400, 200.0, up_s=200.0)
    joined = beat("b", 30, 10.0, up_s=10.0)
    pool = pool_rates([now, joined], {("a", 1000.0): old})
    assert pool.workers == 2
    assert abs(pool.per_worker_groups_per_s - 330 / 110) < 1e-9
    assert abs(pool.groups_per_s - (300 / 100 + 30 / 10)) < 1e-9
    assert abs(pool_rates([now]).per_worker_groups_per_s - 2.0) < 1e-9


def test_trainer_rates_and_plan_rounding():
    steps = [{"time": 10.0 * i, "samples": 32, "step_s": 2.0, "wait_s": 8.0} for i in range(4)]
    consumed, capacity = trainer_rates(steps)
    assert abs(consumed - 3.2) < 1e-9 and abs(capacity - 16.0) < 1e-9
    assert trainer_rates(steps[:1]) == (16.0, 16.0)
    d = Demand("policy", 4, 3.2, 16.0, 8.0, 1.0, 1.0)  # 2 groups/s
    assert plan([d], Pool(1, 0.4, 0.5), headroom=1.0).needed == 4  # exactly 4, not 5
    assert plan([d], Pool(1, 0.4, 0.7), headroom=1.0).needed == 3
    assert plan([d], Pool(9, 9.0, 100.0), headroom=1.0).needed == 1  # never below one

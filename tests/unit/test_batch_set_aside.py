"""Batches the trainer does not train on are set aside: a dead letter with the reason, the ledger counting
their groups dead (never trained) and still balancing; a batch during whose step the trainer died twice is
set aside at its next delivery with the exception recorded. On fakeredis, with batches the dataflow forms."""

from __future__ import annotations

import fakeredis

from astraflow.dataflow.batches import BatchReader
from astraflow.dataflow.ledger import read_ledger
from astraflow.dataflow.service import Dataflow
from astraflow.launch.build import dataflow_setup
from astraflow.settings_load import load_settings
from astraflow.streams import Bus, Keys
from tests.dataflow_helpers import roll_out

BASE = ["run.name=t", "dataflow.feeder.n_samples=4", "dataflow.dataset.size=50", "dataflow.batch.size=8"]


async def two_batches(*overrides: str) -> Bus:
    """A run whose dataflow formed two batches of two groups each for `policy`."""
    settings = load_settings(
        None, [*BASE, "run.models=['policy']", "dataflow.feeder.min_backlog=4", *overrides]
    )
    server = fakeredis.FakeServer(version=(7, 0))
    client = fakeredis.FakeAsyncRedis(server=server, protocol=2)
    bus = Bus(Keys("t"), settings.streams, client, client, reconnect_max_s=1)
    df = Dataflow(dataflow_setup(settings), bus, "df")
    await bus.bootstrap(["policy"])
    await df.feeder.step()
    await roll_out(bus, 100, lambda g, i: float(i % 2))
    while await df.collector.step(1):
        pass
    assert [await df.former.step("policy") for _ in range(2)] == ["ok", "ok"]
    return bus


async def balanced(bus: Bus):
    ledger = await read_ledger(bus, ["policy"])
    assert not ledger.problems(), ledger.render()
    return ledger


async def test_a_set_aside_batch_is_dead_lettered_and_its_groups_count_dead_not_trained():
    bus = await two_batches()
    assert (await balanced(bus)).models["policy"].trained == 4
    reader = BatchReader(bus, "policy", "trainer-policy")
    bad, good = await reader.read(2, block_ms=10)
    reason = "step refused: sample 2: advantage nan is not finite"
    assert await reader.set_aside(bad, reason) == "ok"
    assert await reader.set_aside(bad, reason) == "dup"  # a retry counts nothing twice
    [(_, dead)] = await bus.redis.xrange(bus.keys.dead)
    assert dead[b"reason"].decode() == reason
    assert (dead[b"source_id"].decode(), dead[b"field.uid"].decode()) == (bad.id, bad.batch.uid)
    ledger = await balanced(bus)
    assert (ledger.models["policy"].trained, ledger.models["policy"].dead) == (2, 2)
    assert "dead 2" in ledger.render().splitlines()[-2]  # the identity line counts them dead
    assert await reader.ack([good]) == []  # the next batch goes on as ever
    assert await reader.read(1, block_ms=10) == []


async def test_a_batch_the_trainer_died_on_twice_is_set_aside_with_the_exception():
    bus = await two_batches()
    first = BatchReader(bus, "policy", "trainer-policy")
    [poison] = await first.read(1, block_ms=10)
    assert await first.begin(poison) is None
    await first.failed(poison, "IndexError: index out of range in self")  # then the process dies
    second = BatchReader(bus, "policy", "trainer-policy")  # restarted under its name
    [again] = await second.read(1, block_ms=10)
    assert again.id == poison.id
    assert await second.begin(again) is None  # the second attempt; the process dies again
    third = BatchReader(bus, "policy", "trainer-policy")
    [last] = await third.read(1, block_ms=10)
    why = await third.begin(last)
    assert why == "the trainer died during 2 steps on it; last error: IndexError: index out of range in self"
    assert await third.set_aside(last, why) == "ok"
    [(_, dead)] = await bus.redis.xrange(bus.keys.dead)
    assert dead[b"reason"].decode() == why
    ledger = await balanced(bus)
    assert (ledger.models["policy"].trained, ledger.models["policy"].dead) == (2, 2)
    assert await bus.redis.hlen(bus.keys.errors) == 0  # nothing of its attempts is left behind
    [good] = await third.read(1, block_ms=10)  # the other batch trains
    assert good.id != poison.id and await third.begin(good) is None


async def test_attempts_of_a_batch_whose_steps_ended_are_forgotten():
    bus = await two_batches()
    reader = BatchReader(bus, "policy", "trainer-policy")
    [batch] = await reader.read(1, block_ms=10)
    for _ in range(5):  # retrained after restarts that came between its steps: never set aside
        assert await reader.begin(batch) is None
        await reader.finished(batch)
    assert await bus.redis.hlen(bus.keys.errors) == 0


async def test_with_max_deliveries_two_a_batch_is_set_aside_before_the_claim_would_dead_letter_it():
    bus = await two_batches("streams.max_deliveries=2")
    first = BatchReader(bus, "policy", "trainer-policy")
    [poison] = await first.read(1, block_ms=10)
    assert await first.begin(poison) is None  # the process dies during this step
    second = BatchReader(bus, "policy", "trainer-policy")
    [again] = await second.read(1, block_ms=10)  # the claim hands it out (a third delivery it would not)
    why = await second.begin(again)
    assert why is not None and why.startswith(
        "the trainer died during 1 step on it; last error: none recorded"
    )
    assert await second.set_aside(again, why) == "ok"
    ledger = await balanced(bus)
    assert ledger.models["policy"].dead == 2

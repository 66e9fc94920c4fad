"""The `skip_zero_variance` curator: a prompt whose recent groups were all solved (or all failed) by every
sample is not generated again for a while - the collector would only drop the group unlearned - and the
run reports the share of what it generated that was trained."""

from __future__ import annotations

from astraflow.messages import PromptGroup, decode
from tests.dataflow_helpers import publish_version, roll_out
from tests.unit.test_dataflow import ledger_of, make

SKIP = [
    "dataflow.feeder.curator=skip_zero_variance",
    "dataflow.dataset.size=6",
    "dataflow.feeder.min_backlog=6",
    "dataflow.batch.size=1000",  # nothing is formed; only the feeding matters
    "dataflow.feeder.max_ready_batches=100",
    "dataflow.max_staleness_steps=100",
]


def row(g: PromptGroup) -> int:
    return int(g.uid.split("r")[1])


def reward(g: PromptGroup, i: int) -> float:
    """Row 0 is solved by every sample, row 1 failed by every one; the others are learnable."""
    return {0: 1.0, 1: 0.0}.get(row(g), float(i % 2))


async def feed_round(bus, df, seen: set[str]) -> list[int]:
    """Feed once, roll out and collect everything; the rows newly submitted."""
    await df.feeder.step()
    fresh = [decode(f, PromptGroup) for _, f in await bus.redis.xrange(bus.keys.prompts)]
    fresh = [g for g in fresh if g.uid not in seen]
    seen.update(g.uid for g in fresh)
    await roll_out(bus, 100, reward)
    while await df.collector.step(1):
        pass
    return sorted(row(g) for g in fresh)


async def advance(bus, df, to: int) -> None:
    for v in range(1, to + 1):
        await publish_version(bus, "policy", v)
    await df.barrier.step(1)


async def test_zero_variance_prompts_are_skipped_for_skip_versions_then_tried_again():
    bus, df = make(*SKIP, "dataflow.feeder.skip_versions=3")
    await bus.bootstrap(["policy"])
    seen: set[str] = set()
    assert await feed_round(bus, df, seen) == [0, 1, 2, 3, 4, 5]  # nothing known yet: every row
    later = await feed_round(bus, df, seen)  # the next passes over the dataset, still at version 0
    assert len(later) == 6 and 0 not in later and 1 not in later
    assert (await ledger_of(bus, df)).skipped >= 2
    await advance(bus, df, 2)
    assert {0, 1}.isdisjoint(await feed_round(bus, df, seen))  # 2 versions on: still skipped
    await advance(bus, df, 3)
    again = await feed_round(bus, df, seen) + await feed_round(bus, df, seen)
    assert {0, 1} <= set(again)  # 3 versions on: tried again (and all solved or all failed again)...
    after = await feed_round(bus, df, seen) + await feed_round(bus, df, seen)
    assert {0, 1}.isdisjoint(after)  # ...so skipped again


async def test_skip_after_groups_waits_for_that_many_zero_variance_groups_in_a_row():
    bus, df = make(
        *SKIP,
        "dataflow.feeder.skip_after_groups=2",
        "dataflow.dataset.size=2",
        "dataflow.feeder.min_backlog=2",
    )
    await bus.bootstrap(["policy"])
    seen: set[str] = set()
    assert await feed_round(bus, df, seen) == [0, 1]
    assert await feed_round(bus, df, seen) == [0, 1]  # one zero-variance group each: not yet
    assert await feed_round(bus, df, seen) == []  # two in a row: skipped


async def test_accept_all_submits_zero_variance_prompts_again():
    bus, df = make(*SKIP[1:])
    await bus.bootstrap(["policy"])
    seen: set[str] = set()
    await feed_round(bus, df, seen)
    assert {0, 1} <= set(await feed_round(bus, df, seen))


def test_the_summary_and_the_last_line_give_the_share_of_generated_samples_trained():
    from astraflow.launch.progress import Progress
    from astraflow.launch.report import busy_line, summary

    ledger = {"models": {"policy": {"collected": 200, "trained": 114, "dropped": {"zero_variance": 86}}}}
    data = summary(Progress(None, ["policy"], 10), 10, {"ledger": ledger, "wall_s": 100.0})
    assert data["models"]["policy"]["trained_share"] == 0.57
    assert busy_line(data).endswith("; trained of generated: 57%")

"""Workers started on their own stop by themselves: the first that finds a stop condition met ends the run
for everyone (its reason in the run's identity), every worker follows that notice, and a worker the
launcher started leaves both to it. `astraflow record` leaves the run's record; `astraflow top` prints
plain lines when its output is not a terminal."""

import asyncio
import json
import time

import pytest

from astraflow.dataflow.ledger import read_ledger
from astraflow.launch.progress import Progress
from astraflow.launch.stops import (
    EXIT_ALL_DEAD,
    EXIT_STOPPED_ELSEWHERE,
    AllDead,
    follow_run,
    stop_notice,
    stopped_elsewhere,
    stopped_reason,
)
from astraflow.ops.record import record
from astraflow.settings_load import load_settings
from astraflow.streams.identity import existing, mark_stopped
from astraflow.streams.records import DeadLetterRecord, RolloutStats, TrainerStep, encode_record


async def add_steps(bus, n: int, reward: float = 0.5, model: str = "policy") -> None:
    for v in range(1, n + 1):
        rollouts = RolloutStats(model, 1, 4, reward * 4, time.time())
        await bus.redis.xadd(bus.keys.metrics, encode_record(rollouts))
        stats = {"samples": 4, "step_s": 0.1, "reward_mean": reward}
        step = TrainerStep(model, v, f"b{v}", time.time(), stats)
        await bus.redis.xadd(bus.keys.metrics, encode_record(step))


def settings(*overrides: str):
    return load_settings(overrides=["run.name=t", "run.target_reward=null", *overrides])


async def test_a_worker_that_judges_stops_the_run_for_everyone_at_max_steps(bus):
    s = settings("run.max_steps=3")
    judge, follower = asyncio.Event(), asyncio.Event()
    tasks = [
        asyncio.create_task(follow_run(bus, s, judge, judge=True)),
        asyncio.create_task(follow_run(bus, s, follower, judge=False)),
    ]
    await add_steps(bus, 2)
    await asyncio.sleep(1.5)
    assert not judge.is_set() and not follower.is_set()
    await add_steps(bus, 3)
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert judge.is_set() and follower.is_set()
    assert (await existing(bus)).stopped is not None
    assert await stopped_reason(bus) == "3 steps"


async def test_every_worker_follows_a_stop_notice(bus):
    stop = asyncio.Event()
    task = asyncio.create_task(follow_run(bus, settings(), stop, judge=True))
    await mark_stopped(bus, "by hand")
    await asyncio.wait_for(task, 10)
    assert stop.is_set()


async def test_a_worker_the_launcher_started_leaves_stopping_to_it(bus):
    s = settings("run.max_steps=1", "run.supervised=true")
    await add_steps(bus, 2)
    stop = asyncio.Event()
    await asyncio.wait_for(follow_run(bus, s, stop, judge=True), 5)  # returns at once, sets nothing
    assert not stop.is_set() and (await existing(bus)).stopped is None


async def test_record_leaves_metrics_summary_and_plot_of_a_stopped_run(bus, tmp_path):
    await add_steps(bus, 4, reward=0.25)
    await mark_stopped(bus, "4 steps")
    assert await record(bus, settings(), tmp_path / "rec") == 0
    lines = (tmp_path / "rec" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["version"] for x in lines] == [1, 2, 3, 4]
    summary = json.loads((tmp_path / "rec" / "summary.json").read_text())
    assert summary["stopped"] == "4 steps" and summary["models"]["policy"]["versions"] == 4
    assert summary["models"]["policy"]["reward_last_window"] == pytest.approx(0.25)
    assert (tmp_path / "rec" / "reward.png").stat().st_size > 0


async def test_top_without_a_terminal_prints_lines_timed_from_the_run_start(bus, capsys, monkeypatch):
    from astraflow.ops import top

    await bus.redis.hset(bus.keys.identity, "created", f"{time.time() - 500:.3f}")
    await add_steps(bus, 2)
    monkeypatch.setattr(top, "TOP_LINE_EVERY_S", 0.05)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(top.top(bus, settings()), 0.5)
    out = capsys.readouterr().out.splitlines()
    assert len(out) >= 2 and "policy v2 reward(ma10) 0.500" in out[0]
    assert 500 <= float(out[0].split("s", 1)[0]) < 600  # the run's age, not top's


async def test_a_forged_stop_notice_is_not_a_reached_target(bus):
    """`HSET run:stop` claiming the target at 0 steps (issue 41): the launcher's verdict is its own reading
    of the metrics, so the claim ends the run with EXIT_STOPPED_ELSEWHERE and says who wrote it; a target
    its metrics do show still ends it with 0."""
    s = settings("run.target_reward=0.8", "run.reward_window=2").run
    progress = Progress(bus, ["policy"], s.reward_window)
    assert await stopped_elsewhere(bus, s, progress) is None
    await bus.redis.hset(
        f"{bus.keys.identity}:stop", mapping={"stopped": "1", "stop_reason": "reward target 0.8 reached"}
    )
    await bus.identity()
    reason, status = await stopped_elsewhere(bus, s, progress)
    assert status == EXIT_STOPPED_ELSEWHERE
    assert reason == "stopped elsewhere by an unnamed writer: reward target 0.8 reached"
    await add_steps(bus, 3, reward=0.9)
    assert await stopped_elsewhere(bus, s, progress) == ("reward target 0.8 reached", 0)


async def test_only_the_trainer_ends_a_run_at_its_target_and_the_notice_says_who(bus):
    s = settings("run.target_reward=0.8", "run.reward_window=2")
    await bus.identity()
    await add_steps(bus, 3, reward=0.9)
    stop = asyncio.Event()
    dataflow = asyncio.create_task(follow_run(bus, s, stop, judge=True, by="dataflow"))
    await asyncio.sleep(1.5)
    assert not stop.is_set() and (await existing(bus)).stopped is None
    await asyncio.wait_for(follow_run(bus, s, stop, judge=True, by="trainer"), 5)
    await asyncio.wait_for(dataflow, 5)
    assert await stop_notice(bus) == ("reward target 0.8 reached", "trainer")


async def test_a_run_whose_every_group_is_dead_lettered_ends_with_the_last_reason(bus):
    """No limit set, every group dead-lettered (issue 41): the launcher's watch ends the run after
    `run.stop_after_dead_groups` in a row, with the last dead letter's reason and EXIT_ALL_DEAD; a group
    collected between starts the count again."""
    watch = AllDead(settings().run.stop_after_dead_groups)
    limit = watch.limit

    async def ledger(collected: int, dead: int):
        await bus.redis.hset(bus.keys.ledger, mapping={"submitted": collected + dead, "collected": collected})
        await bus.redis.hset(bus.keys.ledger, mapping={"dead": dead})
        return await read_ledger(bus, ["policy"])

    assert await watch.check(bus, await ledger(0, 0)) is None
    letter = DeadLetterRecord("prompts", "UnknownName: workflow 'nope' is not registered", "1-0")
    await bus.redis.xadd(bus.keys.dead, encode_record(letter))
    assert await watch.check(bus, await ledger(0, limit - 1)) is None
    assert await watch.check(bus, await ledger(1, limit)) is None  # one collected: counted again from here
    assert await watch.check(bus, await ledger(1, 2 * limit - 1)) is None
    reason, status = await watch.check(bus, await ledger(1, 2 * limit))
    assert status == EXIT_ALL_DEAD
    assert reason == (
        f"every prompt group dead-lettered ({limit} in a row, none collected);"
        " the last: UnknownName: workflow 'nope' is not registered"
    )
    assert await AllDead(None).check(bus, await ledger(1, 10 * limit)) is None

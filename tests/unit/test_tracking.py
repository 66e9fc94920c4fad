"""The trackers fed from a run's metrics stream (fakeredis): TensorBoard event files hold the reward curve
and the eval results, each step once, across a restarted feeder and a retrained version."""

from __future__ import annotations

import pytest

from astraflow.errors import ConfigError
from astraflow.streams import Bus
from astraflow.streams.records import EvalResult, EvalSubmitted, RolloutStats, TrainerStep, encode_record
from astraflow.tracking.settings import TrackingSettings
from astraflow.tracking.tracker import open_tracker

pytest.importorskip("tensorboard")
TB = TrackingSettings(sinks=["tensorboard"])


async def step(bus: Bus, version: int, rewards: list[float], loss: float) -> None:
    """What the dataflow writes for the rollouts it collected, then what the trainer writes for a step."""
    rollouts = RolloutStats("policy", 1, len(rewards), sum(rewards), 0)
    await bus.redis.xadd(bus.keys.metrics, encode_record(rollouts))
    stats = {"loss": loss, "reward_mean": 0.0, "samples": len(rewards)}
    await bus.redis.xadd(
        bus.keys.metrics, encode_record(TrainerStep("policy", version, f"b{version}", 0, stats))
    )


async def eval_rows(bus: Bus, version: int, rows: int, passed: float) -> None:
    result = EvalResult("policy", "add", version, rows, {"pass@1": passed}, 0)
    await bus.redis.xadd(bus.keys.metrics, encode_record(result))


def scalars(logdir, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return [(e.step, round(e.value, 6)) for e in acc.Scalars(tag)]


async def feed(bus: Bus, tmp_path, finished: bool = False) -> None:
    tracker = await open_tracker(TB, bus, tmp_path, ["policy"])
    await tracker.drain()
    tracker.close(finished)


async def test_tensorboard_holds_the_reward_curve_and_evals_once_across_restarts(bus, tmp_path):
    for v, reward in enumerate([0.0, 0.25, 0.5], start=1):
        await step(bus, v, [reward, reward], loss=1.0 / v)
    await bus.redis.xadd(bus.keys.metrics, encode_record(EvalSubmitted(2, "add", 4, 0)))
    await eval_rows(bus, 2, 3, 2.0)  # 3 of its 4 rows: not logged yet
    await feed(bus, tmp_path)

    await eval_rows(bus, 2, 1, 1.0)  # the last row: 3 of 4 passed
    await step(bus, 3, [0.9], loss=9.0)  # a restarted trainer trains version 3 again: logged once
    await step(bus, 4, [0.75, 1.0], loss=0.2)
    await feed(bus, tmp_path)  # a second feeder process, from the saved cursor

    logdir = tmp_path / "tracking" / "tensorboard"
    assert scalars(logdir, "policy/reward") == [(1, 0.0), (2, 0.25), (3, 0.5), (4, 0.875)]
    assert scalars(logdir, "policy/loss") == [(1, 1.0), (2, 0.5), (3, round(1 / 3, 6)), (4, 0.2)]
    assert scalars(logdir, "policy/eval/add/pass@1") == [(2, 0.75)]


async def test_an_eval_the_run_stopped_in_is_logged_with_the_rows_scored(bus, tmp_path):
    await bus.redis.xadd(bus.keys.metrics, encode_record(EvalSubmitted(0, "add", 8, 0)))
    await eval_rows(bus, 0, 2, 1.0)
    await feed(bus, tmp_path, finished=True)
    assert scalars(tmp_path / "tracking" / "tensorboard", "policy/eval/add/pass@1") == [(0, 0.5)]


async def test_a_second_feeder_of_one_directory_is_refused_with_the_holders_pid(bus, tmp_path):
    first = await open_tracker(TB, bus, tmp_path, ["policy"])
    try:
        with pytest.raises(ConfigError, match=r"already fed by another process \(pid \d+\)"):
            await open_tracker(TB, bus, tmp_path, ["policy"])
    finally:
        first.close(False)


@pytest.mark.parametrize("sink", ["wandb", "mlflow"])
async def test_a_tracker_not_installed_is_one_line_naming_the_extra(bus, tmp_path, sink):
    import importlib.util

    if importlib.util.find_spec(sink) is not None:
        pytest.skip(f"{sink} is installed")
    with pytest.raises(
        ConfigError, match=rf"^tracking.sinks: {sink} needs {sink}: pip install 'astraflow\[{sink}\]'$"
    ):
        await open_tracker(TrackingSettings(sinks=[sink]), bus, tmp_path, ["policy"])

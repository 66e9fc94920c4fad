"""`astraflow track` against a real Redis: a run's metrics stream into TensorBoard, from the command line."""

import asyncio
import subprocess
import sys

import pytest

from astraflow.cli import main
from astraflow.streams.records import RolloutStats, TrainerStep, encode_record

pytestmark = [pytest.mark.integration, pytest.mark.slow]
pytest.importorskip("tensorboard")


def track(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "astraflow.cli", *args], capture_output=True, text=True, timeout=60
    )


async def test_track_once_writes_the_reward_curve_and_a_rerun_adds_nothing(bus, redis_url, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for v in (1, 2):
        await bus.redis.xadd(bus.keys.metrics, encode_record(RolloutStats("policy", 1, 2, v / 2, 0)))
        trainer = TrainerStep("policy", v, f"b{v}", 0, {"loss": 1.0})
        await bus.redis.xadd(bus.keys.metrics, encode_record(trainer))
    args = ["track", "--redis", redis_url, "--run", "it", "--once", "--set", "tracking.sinks=[tensorboard]"]
    args += ["--set", f"tracking.dir={tmp_path}"]
    first = await asyncio.to_thread(track, args)
    assert first.returncode == 0, first.stderr
    again = await asyncio.to_thread(track, args)  # from the saved cursor: nothing new
    assert again.returncode == 0, again.stderr
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("policy/reward")] == [(1, 0.25), (2, 0.5)]
    assert "{'policy': 2}" in again.stdout


def test_track_without_sinks_says_how_to_set_one(capsys):
    assert main(["track", "--redis", "redis://127.0.0.1:1", "--run", "it"]) == 1
    assert "tracking.sinks: none set" in capsys.readouterr().err

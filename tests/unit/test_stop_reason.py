"""What `astraflow run` stops at tells in its exit status: 0 at the reward target or at a limit when no
target is set, EXIT_TARGET_MISSED at a step or time limit before the target a run was sent for."""

import time
from types import SimpleNamespace

from astraflow.launch.stops import EXIT_TARGET_MISSED, stop_reason
from astraflow.settings_load import load_settings


def progress(rewards: list[float], started_s_ago: float = 0.0):
    steps = [(v, float(v), r) for v, r in enumerate(rewards, 1)]
    return SimpleNamespace(
        models={"policy": SimpleNamespace(steps=steps)}, started=time.time() - started_s_ago
    )


def test_the_target_reached_is_0():
    s = load_settings(overrides=["run.target_reward=0.5", "run.reward_window=2", "run.max_steps=4"])
    assert stop_reason(s.run, progress([0.1, 0.6, 0.6])) == ("reward target 0.5 reached", 0)
    assert stop_reason(s.run, progress([0.1, 0.2])) is None


def test_a_limit_before_the_target_is_a_miss():
    s = load_settings(overrides=["run.target_reward=0.9", "run.reward_window=2", "run.max_steps=4"])
    assert stop_reason(s.run, progress([0.1] * 4)) == ("4 steps", EXIT_TARGET_MISSED)
    s = load_settings(overrides=["run.target_reward=0.9", "run.max_time_s=60"])
    assert stop_reason(s.run, progress([0.1], started_s_ago=61)) == ("time limit 60s", EXIT_TARGET_MISSED)


def test_a_limit_without_a_target_is_the_stop_condition():
    s = load_settings(overrides=["run.target_reward=null", "run.max_steps=4", "run.max_time_s=60"])
    assert stop_reason(s.run, progress([0.1] * 4)) == ("4 steps", 0)
    assert stop_reason(s.run, progress([0.1], started_s_ago=61)) == ("time limit 60s", 0)

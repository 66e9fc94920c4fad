"""A reward that returns NaN or an infinity, or raises, is a scored failure with its reason (reward 0.0),
never a non-finite reward in a trajectory: run inline and in the reward process pool."""

import math

import pytest

from astraflow.workflows.api import reward
from astraflow.workflows.rewards import RewardRunner


@reward("test_nan_inline", inline=True)
def nan_inline(prompt: str, completion: str, **sample) -> float:
    return math.nan


@reward("test_value_in_pool")
def value_in_pool(prompt: str, completion: str, value: str = "0", **sample) -> float:
    if value == "raise":
        raise RuntimeError("the judge is down")
    return float(value)


@pytest.fixture
async def runner():
    r = RewardRunner(processes=1, timeout_s=30)
    yield r
    r.close()


async def test_a_reward_returning_nan_inline_is_a_scored_failure_with_the_reason(runner):
    score, error = await runner.score("test_nan_inline", "p", "c", {})
    assert score == 0.0
    assert error == "reward 'test_nan_inline' raised NonFiniteReward: returned nan, not a finite number"


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
async def test_a_reward_returning_a_non_finite_value_in_the_pool_is_a_scored_failure(runner, value):
    score, error = await runner.score("test_value_in_pool", "p", "c", {"value": value})
    assert score == 0.0 and math.isfinite(score)
    assert f"returned {float(value)}, not a finite number" in error


async def test_a_reward_that_raises_in_the_pool_is_a_scored_failure_and_a_finite_one_scores(runner):
    assert await runner.score("test_value_in_pool", "p", "c", {"value": "0.25"}) == (0.25, None)
    score, error = await runner.score("test_value_in_pool", "p", "c", {"value": "raise"})
    assert (score, error) == (0.0, "reward 'test_value_in_pool' raised RuntimeError: the judge is down")

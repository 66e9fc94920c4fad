"""A reward's `timeout_s` limits its own running, in its pool process: importing its module is not
counted (a reward importing torch on a busy machine once timed out on every call, each timeout starting a
fresh pool that imported it again), a reward hanging in Python is stopped at the timeout and its process
kept, and one the timer cannot reach (a hang in C) still ends: its pool is replaced."""

import signal
import time

import pytest

from astraflow.workflows.rewards import RewardRunner
from tests.unit.slow_import_reward import IMPORT_S

HERE = "tests.unit.test_reward_timeouts"
SLOW_IMPORT = "tests.unit.slow_import_reward:one"


def hang(prompt, completion, **sample):
    try:
        while True:
            time.sleep(0.05)
    except Exception:  # a reward's own catch-all must not swallow the timeout
        return 1.0


def hang_in_c(prompt, completion, **sample):
    """Blocks the timer's signal, as a call stuck in C code never reaches Python's handler."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    time.sleep(3600)


def half(prompt, completion, **sample):
    return 0.5


@pytest.fixture
async def runner():
    allowed = [SLOW_IMPORT, f"{HERE}:hang", f"{HERE}:hang_in_c", f"{HERE}:half"]
    r = RewardRunner(processes=1, timeout_s=0.5, allowed=allowed, start_grace_s=3 * IMPORT_S)
    yield r
    r.close()


async def test_a_reward_whose_module_imports_slower_than_its_timeout_still_scores(runner):
    assert IMPORT_S > runner.timeout_s
    assert await runner.score(SLOW_IMPORT, "p", "c", {}) == (1.0, None)
    assert await runner.score(SLOW_IMPORT, "p", "c", {}) == (1.0, None)


async def test_a_reward_hanging_in_python_is_stopped_at_its_timeout_and_its_process_goes_on(runner):
    assert await runner.score(f"{HERE}:half", "p", "c", {}) == (0.5, None)
    pool = runner._pool
    score, error = await runner.score(f"{HERE}:hang", "p", "c", {})
    assert (score, error) == (0.0, f"reward '{HERE}:hang' timed out after 0.5s")
    assert runner._pool is pool  # the same process, its imports kept
    assert await runner.score(f"{HERE}:half", "p", "c", {}) == (0.5, None)


async def test_a_reward_hanging_where_the_timer_cannot_reach_gets_a_fresh_pool(runner):
    pool = runner._pool
    score, error = await runner.score(f"{HERE}:hang_in_c", "p", "c", {})
    assert (
        score == 0.0
        and error == f"reward '{HERE}:hang_in_c' timed out after 0.5s (its process did not answer)"
    )
    assert runner._pool is not pool
    assert await runner.score(f"{HERE}:half", "p", "c", {}) == (0.5, None)

"""A reward's `timeout_s` limits its own running, in its pool process: importing its module is not
counted (a reward importing torch on a busy machine once timed out on every call, each timeout starting a
fresh pool that imported it again), a reward hanging in Python is stopped at the timeout and its process
kept (even when the reward sets and clears `signal.alarm` itself, as math_verify's parser does), one
stopped mid-import gets a fresh pool, and one the watchdog cannot reach (a hang in C) still ends: its
pool is replaced. A reward's own TimeoutError is its error, not a hang."""

import signal
import time

import pytest

from astraflow.workflows.rewards import WATCHDOG, RewardRunner

HERE = "tests.unit.test_reward_timeouts"
SLOW_IMPORT = "tests.unit.slow_import_reward:one"
TIMEOUT_S = 0.5


def hang(prompt, completion, **sample):
    signal.alarm(5)  # as math_verify's parser does around its work
    signal.alarm(0)
    try:
        while True:
            time.sleep(0.05)
    except Exception:  # a reward's own catch-all must not swallow the timeout
        return 1.0


def hang_in_c(prompt, completion, **sample):
    """Blocks the watchdog's signal, as a call stuck in C code never reaches Python's handler."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {WATCHDOG})
    time.sleep(3600)


def lazy(prompt, completion, **sample):
    import tests.unit.slow_import_reward  # noqa: F401  (a slow import inside the call)

    return 1.0


def own_timeout(prompt, completion, **sample):
    raise TimeoutError("the judge did not answer")


def half(prompt, completion, **sample):
    return 0.5


def runner_with(timeout_s: float, grace_s: float) -> RewardRunner:
    names = ["hang", "hang_in_c", "lazy", "own_timeout", "half"]
    return RewardRunner(1, timeout_s, [SLOW_IMPORT, *(f"{HERE}:{n}" for n in names)], start_grace_s=grace_s)


@pytest.fixture
async def runner():
    r = runner_with(TIMEOUT_S, 5.0)
    yield r
    r.close()


async def test_a_reward_whose_module_imports_slower_than_its_timeout_still_scores(runner):
    from tests.unit.slow_import_reward import IMPORT_S

    assert IMPORT_S > runner.timeout_s
    assert await runner.score(SLOW_IMPORT, "p", "c", {}) == (1.0, None)
    assert await runner.score(SLOW_IMPORT, "p", "c", {}) == (1.0, None)


async def test_a_reward_hanging_in_python_is_stopped_at_its_timeout_and_its_process_goes_on(runner):
    assert await runner.score(f"{HERE}:half", "p", "c", {}) == (0.5, None)
    pool = runner._pool
    score, error = await runner.score(f"{HERE}:hang", "p", "c", {})
    assert (score, error) == (0.0, f"reward '{HERE}:hang' timed out after {TIMEOUT_S}s")
    assert runner._pool is pool  # the same process, its imports kept
    assert await runner.score(f"{HERE}:half", "p", "c", {}) == (0.5, None)


async def test_a_reward_stopped_in_an_import_gets_a_fresh_pool(runner):
    pool = runner._pool
    score, error = await runner.score(f"{HERE}:lazy", "p", "c", {})
    assert (score, error) == (0.0, f"reward '{HERE}:lazy' timed out after {TIMEOUT_S}s")
    assert runner._pool is not pool
    assert await runner.score(f"{HERE}:half", "p", "c", {}) == (0.5, None)


async def test_a_reward_raising_its_own_timeout_error_keeps_the_pool(runner):
    pool = runner._pool
    score, error = await runner.score(f"{HERE}:own_timeout", "p", "c", {})
    assert error == f"reward '{HERE}:own_timeout' raised TimeoutError: the judge did not answer"
    assert score == 0.0 and runner._pool is pool


async def test_a_reward_hanging_where_the_watchdog_cannot_reach_gets_a_fresh_pool():
    runner = runner_with(2.0, 3.0)  # time enough to block the signal before the watchdog fires
    try:
        pool = runner._pool
        score, error = await runner.score(f"{HERE}:hang_in_c", "p", "c", {})
        assert score == 0.0 and error == f"reward '{HERE}:hang_in_c' timed out after 2.0s (no answer in 5.0s)"
        assert runner._pool is not pool
        assert await runner.score(f"{HERE}:half", "p", "c", {}) == (0.5, None)
    finally:
        runner.close()

"""Concurrent identical requests share one call (`engines.merge`)."""

import asyncio

import pytest

from astraflow.engines.merge import Merger


class Calls:
    """A call that returns n numbered results and records each n it was asked for."""

    def __init__(self, delay: float = 0.0, fail: Exception | None = None) -> None:
        self.asked: list[int] = []
        self.delay, self.fail = delay, fail

    async def __call__(self, n: int) -> list[tuple[int, int]]:
        self.asked.append(n)
        k = len(self.asked)
        await asyncio.sleep(self.delay)
        if self.fail is not None:
            raise self.fail
        return [(k, i) for i in range(n)]


async def test_a_groups_calls_in_one_turn_become_one_call_and_each_gets_its_own_result():
    m, calls = Merger(8), Calls()
    results = await asyncio.gather(*[m.one("p", calls) for _ in range(8)])
    assert calls.asked == [8]
    assert sorted(results) == [(1, i) for i in range(8)]


async def test_a_group_above_the_cap_goes_as_several_calls_of_at_most_the_cap():
    m, calls = Merger(3), Calls()
    results = await asyncio.gather(*[m.one("p", calls) for _ in range(8)])
    assert calls.asked == [3, 3, 2] and len(set(results)) == 8
    calls.asked.clear()
    await asyncio.gather(*[Merger(1).one("p", calls) for _ in range(2)])  # a cap of 1: never merged
    assert calls.asked == [1, 1]


async def test_other_keys_no_key_and_later_turns_get_calls_of_their_own():
    m, calls = Merger(8), Calls()
    await asyncio.gather(m.one("a", calls), m.one("a", calls), m.one("b", calls), m.one(None, calls))
    assert sorted(calls.asked) == [1, 1, 2]
    calls.asked.clear()
    await m.one("a", calls)
    await m.one("a", calls)  # the first had been sent: no group to join
    assert calls.asked == [1, 1]


async def test_a_failed_call_is_every_merged_callers_error():
    m, calls = Merger(8), Calls(fail=ValueError("server said no"))
    results = await asyncio.gather(*[m.one("p", calls) for _ in range(3)], return_exceptions=True)
    assert calls.asked == [3]
    assert all(isinstance(r, ValueError) for r in results)


async def test_a_call_with_too_few_results_fails_every_caller():
    async def short(n: int) -> list[int]:
        return [0] * (n - 1)

    with pytest.raises(RuntimeError, match="asked for 1"):
        await Merger(8).one("p", short)
    m = Merger(8)
    results = await asyncio.gather(*[m.one("p", short) for _ in range(3)], return_exceptions=True)
    assert all(isinstance(r, RuntimeError) and "asked for 3" in str(r) for r in results)


async def test_when_the_carrying_caller_is_cancelled_the_others_call_again():
    m, calls = Merger(8), Calls(delay=0.05)
    tasks = [asyncio.create_task(m.one("p", calls)) for _ in range(4)]
    await asyncio.sleep(0.01)  # the merged call is under way
    tasks[0].cancel()
    results = await asyncio.gather(*tasks[1:])
    assert tasks[0].cancelled() and calls.asked == [4, 3]
    assert sorted(results) == [(2, i) for i in range(3)]


async def test_a_cancelled_follower_leaves_the_others_their_results():
    m, calls = Merger(8), Calls(delay=0.05)
    tasks = [asyncio.create_task(m.one("p", calls)) for _ in range(3)]
    await asyncio.sleep(0.01)
    tasks[2].cancel()
    assert sorted(await asyncio.gather(*tasks[:2])) == [(1, 0), (1, 1)]
    with pytest.raises(asyncio.CancelledError):
        await tasks[2]
    assert calls.asked == [3]

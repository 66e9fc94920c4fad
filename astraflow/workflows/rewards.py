"""Built-in rewards, and the process pool that runs reward code with a timeout.

Reward code is the user's and may raise, hang or burn CPU: it runs in worker processes, each call
limited to `timeout_s` of its own running there (a watchdog in the process; importing the reward's
module, the first time a process runs it, is not counted: user rewards often import torch, which takes
longer than a call on a busy machine). A call stopped there leaves its process running, unless it was
importing (a half-done import may not be tried again in that process): then the pool is replaced. A call
that does not answer within `timeout_s + START_GRACE_S` (a hang in C code, out of the watchdog's reach)
gets the pool's processes killed (ours, by pid) and a fresh pool. Either way the trajectory is marked
failed with the reason and the worker goes on.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import multiprocessing as mp
import os
import signal
import threading
from collections.abc import Callable, Collection
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from astraflow.workflows import sandbox
from astraflow.workflows.api import INLINE_REWARDS, load, resolve_reward, reward

START_GRACE_S = 60.0
"""Seconds a call may take besides `timeout_s` before its pool is replaced: a fresh process starting and
importing the reward's module (torch alone takes seconds, many on a loaded machine)."""
WATCHDOG = signal.SIGUSR2
"""The signal a pool process's watchdog sends its main thread at a call's timeout. Not SIGALRM: rewards
set and clear `signal.alarm` themselves (math_verify's parser does), which would cancel the timer."""


@reward("exact_match", inline=True)
def exact_match(prompt: str, completion: str, answer: str = "", **sample: Any) -> float:
    """1.0 when the completion, stripped, is exactly the answer."""
    return 1.0 if completion.strip() == str(answer).strip() else 0.0


@reward("math_verify")
def math_verify(prompt: str, completion: str, answer: str = "", **sample: Any) -> float:
    """1.0 when `math_verify` finds the completion's final answer equal to the reference answer."""
    from math_verify import parse, verify

    return 1.0 if verify(parse(str(answer)), parse(completion)) else 0.0


@reward("gsm8k")
def gsm8k(prompt: str, completion: str, answer: str = "", **sample: Any) -> float:
    """GSM8K: the reference is a worked solution ending in `#### <number>`; 1.0 when the completion's final
    answer (its last number, or a `\\boxed{}` one) equals that number, as `math_verify` judges it."""
    return math_verify(prompt, completion, str(answer).rpartition("####")[2].strip(), **sample)


TOKEN_FIELDS = ("prompt_ids", "completion_ids")
"""Keyword arguments a reward gets besides the row's fields: the token ids the policy saw and sampled."""


def _score(
    fn: Callable[..., float], prompt: str, completion: str, sample: dict[str, Any], ids: dict[str, list[int]]
) -> float:
    """`fn(prompt, completion, **row fields, prompt_ids=..., completion_ids=...)`; the ids only where `fn`
    takes them (by name or `**kwargs`), so a reward written for text alone keeps working."""
    fields = {k: v for k, v in sample.items() if k not in ("prompt", "completion")}
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    fields.update({k: v for k, v in ids.items() if takes_any or k in params})
    value = float(fn(prompt, completion, **fields))
    if not math.isfinite(value):  # a NaN reward would poison every advantage of its group
        raise NonFiniteReward(f"returned {value}, not a finite number")
    return value


class NonFiniteReward(ValueError):
    """A reward returned NaN or an infinity."""


class RewardTimedOut(Exception):
    """A reward ran past its `timeout_s` in its pool process. Its one arg: whether it was in an import
    then, so that the process may hold a half-initialised module."""


class _Alarm(BaseException):
    """The watchdog went off (a BaseException: a reward's own `except Exception` cannot swallow it)."""

    def __init__(self, importing: bool) -> None:
        self.importing = importing


def _alarm(signum: int, frame: Any) -> None:
    raise _Alarm(_importing(frame))


def _importing(frame: Any) -> bool:
    """Whether `frame` runs inside an import (a frame of importlib's bootstrap below it)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _score_in_pool(
    target: str,
    timeout_s: float,
    prompt: str,
    completion: str,
    sample: dict[str, Any],
    ids: dict[str, list[int]],
) -> float:
    """In a pool process: `target` is the `module:qualname` of a reward the worker already resolved; it
    is imported before the watchdog starts, so only the reward's own running counts against `timeout_s`."""
    fn = load(target, "reward")
    previous = signal.signal(WATCHDOG, _alarm)
    watchdog = threading.Timer(timeout_s, signal.pthread_kill, (threading.get_ident(), WATCHDOG))
    try:
        watchdog.start()
        try:
            return _score(fn, prompt, completion, sample, ids)
        finally:
            watchdog.cancel()
            watchdog.join()  # a signal it sent is handled here, before the handler is put back
    except _Alarm as e:
        raise RewardTimedOut(e.importing) from None
    finally:
        signal.signal(WATCHDOG, previous)


class RewardRunner:
    """Scores completions in a process pool; `score` never raises for the reward's own failures.

    `allowed`: the `module:Name` rewards the recipe names; a name neither registered nor allowed is refused
    without importing anything."""

    def __init__(
        self,
        processes: int = 2,
        timeout_s: float = 10.0,
        allowed: Collection[str] = (),
        start_grace_s: float = START_GRACE_S,
        sandbox: str = "namespaces",
    ) -> None:
        self.processes, self.timeout_s, self.allowed = processes, timeout_s, frozenset(allowed)
        self.sandbox = sandbox
        """`raas.sandbox`, taken by the pool's processes for the tool calls of rewards that run code."""
        self.start_grace_s = start_grace_s
        # A call is submitted only when a process is free, so its timeout measures running, not queueing.
        self._free = asyncio.Semaphore(processes)
        self._pool = self._new_pool()

    def _new_pool(self) -> ProcessPoolExecutor:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([__name__, "math_verify"])  # processes start with these imported
        return ProcessPoolExecutor(
            self.processes, mp_context=ctx, initializer=sandbox.allow, initargs=(self.sandbox,)
        )

    async def score(
        self,
        name: str,
        prompt: str,
        completion: str,
        sample: dict[str, Any],
        prompt_ids: list[int] | None = None,
        completion_ids: list[int] | None = None,
    ) -> tuple[float, str | None]:
        """(reward, None), or (0.0, reason) when the reward raised or timed out. The token ids, when the
        workflow gives them, reach rewards that take `prompt_ids` / `completion_ids` (as lists of ints)."""
        given = {"prompt_ids": prompt_ids, "completion_ids": completion_ids}
        ids = {k: [int(t) for t in v] for k, v in given.items() if v is not None}
        try:
            fn = resolve_reward(name, self.allowed)
        except ValueError as e:
            return 0.0, str(e)
        if name in INLINE_REWARDS:
            try:
                return _score(fn, prompt, completion, sample, ids), None
            except Exception as e:
                return 0.0, f"reward {name!r} raised {type(e).__name__}: {e}"
        # The pool's processes import the function by its module path, so rewards registered by name
        # in the user's module work there too.
        target = f"{fn.__module__}:{fn.__qualname__}"
        timed_out = f"reward {name!r} timed out after {self.timeout_s}s"
        for attempt in range(2):
            async with self._free:
                pool = self._pool
                try:
                    future = asyncio.wrap_future(
                        pool.submit(_score_in_pool, target, self.timeout_s, prompt, completion, sample, ids)
                    )
                    waited = self.timeout_s + self.start_grace_s
                    done, _ = await asyncio.wait({future}, timeout=waited)
                    if not done:  # a hang in C, or a process that cannot start
                        self._restart(pool)
                        return 0.0, f"{timed_out} (no answer in {waited}s)"
                    return future.result(), None  # (a TimeoutError of the reward's own is its error)
                except asyncio.CancelledError:
                    self._restart(pool)  # the running call cannot be cancelled: end its process
                    raise
                except RewardTimedOut as e:  # the watchdog stopped it: the process goes on, unless mid-import
                    if e.args[0]:
                        self._restart(pool)
                    return 0.0, timed_out
                except BrokenProcessPool:
                    if attempt:  # the pool broke twice under this call: give up on it
                        return 0.0, f"reward {name!r} crashed its process"
                    self._restart(pool)  # another call's timeout replaced the pool: retry once
                except Exception as e:
                    return 0.0, f"reward {name!r} raised {type(e).__name__}: {e}"
        raise AssertionError("unreachable")

    def _restart(self, pool: ProcessPoolExecutor) -> None:
        if pool is not self._pool:
            return
        _kill(pool)
        self._pool = self._new_pool()

    def close(self) -> None:
        """Stop now: rewards still running are killed (a hanging one must not hold up the exit)."""
        _kill(self._pool)


def _kill(pool: ProcessPoolExecutor) -> None:
    """SIGKILL the pool's own worker processes, then shut it down without waiting."""
    for pid in list(getattr(pool, "_processes", {}) or {}):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    pool.shutdown(wait=False, cancel_futures=True)

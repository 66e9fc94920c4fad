"""Concurrent identical requests as one call.

The RaaS starts a prompt group's episodes together, so their first calls to the engine arrive in the same
turn of the event loop with the same prompt and sampling. A server samples n completions of one prompt in
one call (`n`) for much less than n calls: one HTTP round trip and one request through its API server
(and, with prefix caching, one prefill). `Merger.one` collects the calls with equal keys that arrive in
one turn, up to `max_n`, and makes one call for all of them; each caller gets its own completion. The
engine decides which calls may merge (their key; None: never), e.g. not seeded ones, whose seed names one
sample.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from typing import TypeVar

T = TypeVar("T")


class _LeaderCancelled(Exception):
    """The call that carried a merged request was cancelled: its followers call again."""


class Merger:
    def __init__(self, max_n: int) -> None:
        self.max_n = max_n
        """The most calls one call carries (a server takes at most so many completions a call)."""
        self._forming: dict[Hashable, list[asyncio.Future]] = {}

    async def one(self, key: Hashable | None, call: Callable[[int], Awaitable[list[T]]]) -> T:
        """The first of `call(1)`'s results, or one of the n results of `call(n)` made once for the n calls
        (at most `max_n`) with `key` that arrived in this turn of the event loop (`key` None: never
        merged). `call(n)` must return n results; its error is every merged caller's (the same exception
        object, raised in each). A cancelled caller cancels only itself; if it was the one carrying the
        others, they call again (what the cancelled call had generated is lost)."""
        if key is None or self.max_n <= 1:
            return (await call(1))[0]
        forming = self._forming.get(key)
        if forming is not None:
            joined = asyncio.get_running_loop().create_future()
            forming.append(joined)
            if 1 + len(forming) >= self.max_n:  # full: the next such call starts a group of its own
                del self._forming[key]
            try:
                return await joined
            except _LeaderCancelled:
                return await self.one(key, call)
        others: list[asyncio.Future] = []
        self._forming[key] = others
        try:
            try:
                await asyncio.sleep(0)  # the calls made in this turn join
            finally:
                if self._forming.get(key) is others:
                    del self._forming[key]
            results = await call(1 + len(others))
            if len(results) != 1 + len(others):
                raise RuntimeError(f"asked for {1 + len(others)} completions, got {len(results)}")
        except BaseException as e:
            orphaned = _LeaderCancelled() if isinstance(e, asyncio.CancelledError) else e
            for f in others:
                if not f.done():
                    f.set_exception(orphaned)
            raise
        for f, result in zip(others, results[1:], strict=True):
            if not f.done():  # a follower cancelled meanwhile drops its completion
                f.set_result(result)
        return results[0]

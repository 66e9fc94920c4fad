"""Which versions a trainer publishes as eval versions: every `eval.every`-th one, and with `eval.every_s`
the first one published that many seconds after the last (version 0 either way)."""

from __future__ import annotations

import time
from collections.abc import Callable


class EvalCadence:
    def __init__(self, every: int, every_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.every, self.every_s, self.clock = every, every_s, clock
        self._last: float | None = None
        """When the last eval version was flagged (None: none yet in this process)."""

    def flag(self, version: int) -> bool:
        """Whether `version`, published now, is an eval version (asked once per version published). A
        trainer restarted past version 0 starts the clock at its first version instead of flagging it."""
        now = self.clock()
        if self.every > 0 and version % self.every == 0:
            self._last = now
            return True
        if self.every_s <= 0:
            return False
        if version == 0 or (self._last is not None and now - self._last >= self.every_s):
            self._last = now
            return True
        if self._last is None:
            self._last = now
        return False

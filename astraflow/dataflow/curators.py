"""Prompt curators: whether the feeder submits a dataset row now. State lives in Redis, written by each
curator's Lua half (`lua/curators/<name>.lua`, run by collect.lua and announce.lua for the curator of that
registered name), so every replica decides the same way.

A curator is its class here, registered by name (`@curator("name")`: the value of `feeder.curator`; the
settings' `Literal` is built from `CURATORS`), and that file. This module imports nothing at run time that
imports the settings, so the settings can read the registry.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ClassVar

from astraflow.streams.schema import Greso, GresoKind

if TYPE_CHECKING:
    from astraflow.dataflow.settings import FeederSettings
    from astraflow.streams import Bus

CURATORS: dict[str, type[Curator]] = {}
"""Registered name -> curator class, in registration order."""
STREAK = "streak"
"""The hash of per-row zero-variance streaks (`Keys.curator(STREAK)`: the Lua halves' `Key.streak`)."""


def curator(name: str) -> Callable[[type[Curator]], type[Curator]]:
    """Register a curator class under `name` (a value of `feeder.curator`)."""

    def register(cls: type[Curator]) -> type[Curator]:
        CURATORS[name] = cls
        cls.name = name
        return cls

    return register


class Curator(ABC):
    name: ClassVar[str] = ""
    """The name it is registered under (`curator`)."""
    state: ClassVar[str] = ""
    """The curator's own hash (`Keys.curator(state)`: its Lua half's `Key.curator`); '' = none."""

    @classmethod
    def lua_params(cls, settings: FeederSettings) -> dict[str, object]:
        """The settings its Lua half reads (`params`)."""
        return {}

    def __init__(self, bus: Bus, settings: FeederSettings) -> None:
        self.bus, self.settings = bus, settings

    @abstractmethod
    async def decide(self, rows: Sequence[int], randoms: Sequence[float], version: int) -> list[bool]:
        """Submit or skip each row; `randoms` are uniform in [0, 1), one per row, fixed per position;
        `version`: the newest version announced to the RaaS pool."""

    async def _get(self, name: str, rows: Sequence[int]) -> list[bytes | None]:
        key = self.bus.keys.curator(name)
        return await self.bus.call(lambda: self.bus.redis.hmget(key, [str(r) for r in rows]))


@curator("accept_all")
class AcceptAll(Curator):
    """Submit every row."""

    async def decide(self, rows: Sequence[int], randoms: Sequence[float], version: int) -> list[bool]:
        return [True] * len(rows)


@curator("filter_solved")
class FilterSolved(Curator):
    """Skip prompts whose success-rate EWMA (mean reward of its groups) is above the threshold."""

    state = "ewma"

    @classmethod
    def lua_params(cls, settings: FeederSettings) -> dict[str, object]:
        return {"alpha": settings.solved_alpha}

    async def decide(self, rows: Sequence[int], randoms: Sequence[float], version: int) -> list[bool]:
        limit = self.settings.solved_threshold
        return [v is None or float(v) <= limit for v in await self._get(self.state, rows)]


@curator("greso")
class GresoCurator(Curator):
    """GRESO: a prompt whose last s groups all had zero reward variance is submitted with probability
    max(floor, p^s), p = p_easy (they were all right) or p_hard (all wrong). The p's adapt once per
    version toward target shares of zero-variance groups (announce.lua)."""

    state = "greso"

    @classmethod
    def lua_params(cls, settings: FeederSettings) -> dict[str, object]:
        g = settings.greso
        return {
            "p_init": g.p_init,
            "step": g.step,
            "floor": g.floor,
            "target_easy": g.target_easy,
            "target_hard": g.target_hard,
        }

    async def decide(self, rows: Sequence[int], randoms: Sequence[float], version: int) -> list[bool]:
        g = self.settings.greso
        key = self.bus.keys.curator(self.state)
        kinds = (GresoKind.easy, GresoKind.hard)
        fields = [Greso.p(kind) for kind in kinds]
        found = await self.bus.call(lambda: self.bus.redis.hmget(key, fields))
        p = {kind: float(v or g.p_init) for kind, v in zip(kinds, found, strict=True)}
        out = []
        for streak, u in zip(await self._get(STREAK, rows), randoms, strict=True):
            if streak is None:
                out.append(True)
                continue
            count, kind = streak.decode().split()
            out.append(u < max(g.floor, p[kind] ** int(count)))
        return out


@curator("skip_zero_variance")
class SkipZeroVariance(Curator):
    """Skip a prompt whose last `skip_after_groups` groups all had zero reward variance - every sample
    solved it, or every one failed it, so the collector dropped them unlearned - until `skip_versions`
    versions have passed since the last of them; then it is submitted again (the policy has moved), and
    skipped again for as long if that group is zero-variance too. Deterministic, unlike GRESO."""

    async def decide(self, rows: Sequence[int], randoms: Sequence[float], version: int) -> list[bool]:
        after, wait = self.settings.skip_after_groups, self.settings.skip_versions
        out = []
        for streak in await self._get(STREAK, rows):  # `<zero-variance groups in a row> <version>`
            if streak is None:
                out.append(True)
                continue
            count, at = streak.decode().split()
            out.append(int(count) < after or version - int(at) >= wait)
        return out


def make_curator(bus: Bus, settings: FeederSettings) -> Curator:
    try:
        return CURATORS[settings.curator](bus, settings)
    except KeyError:
        raise ValueError(f"unknown curator: {settings.curator!r}") from None

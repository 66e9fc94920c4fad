"""The run state as its readers see it: the `state` hash (the dataflow's; names in `schema.State`) read
through typed accessors, so no reader spells a field.

The dataflow writes the state in its Lua scripts; the dataflow's own steps, the trainers' weight
publishers and operator commands read it here.
"""

from __future__ import annotations

import functools
from collections.abc import Collection

from astraflow.streams.bus import Bus
from astraflow.streams.schema import Family, State

MAX_VERSION_STEP = 64
"""How far past its model's recorded version a published version may be (a trainer publishes one per
step): one further is refused by the dataflow and ignored by whoever looks for the newest (a forged entry
at v = 10^9 would make every rollout stale)."""
VERSIONED = (State.eval, State.eval_submitted, State.eval_pending, State.manifest, State.checkpoint)
"""Fields kept per version (forgotten once far behind the announced one)."""


class RunState(dict[str, str]):
    """A snapshot of the state hash (field -> value, decoded)."""

    @property
    def notice(self) -> int | None:
        """The last version announced to the RaaS pool (None: none yet)."""
        value = self.get(State.notice)
        return None if value is None else int(value)

    @property
    def cursor(self) -> int:
        return int(self.get(State.cursor, 0))

    @property
    def rollback(self) -> bool:
        """A restarted trainer moved a version back: the next notice goes out although not new."""
        return State.rollback in self

    def version(self, model: str) -> int | None:
        """The trainer version recorded for `model` (None: its trainer published nothing yet)."""
        value = self.get(State.version(model))
        return None if value is None else int(value)

    def incarnation(self, model: str) -> str | None:
        return self.get(State.incarnation(model))

    def manifest(self, model: str, version: int) -> str:
        return self.get(State.manifest(model, version), "")

    def checkpoint(self, model: str, version: int) -> str:
        return self.get(State.checkpoint(model, version), "")

    def is_eval(self, version: int) -> bool:
        return State.eval(version) in self

    def eval_versions(self) -> list[int]:
        """Every eval version recorded (ascending)."""
        found = (_versioned(name) for name in self)
        return sorted(f[1] for f in found if f is not None and f[0] is State.eval)

    def eval_submitted(self, version: int) -> float | None:
        """When the eval groups of `version` were submitted (None: not yet)."""
        value = self.get(State.eval_submitted(version))
        return None if value is None else float(value)

    def eval_pending(self, version: int) -> int:
        return int(self.get(State.eval_pending(version), 0))

    def batch_version(self, model: str) -> int:
        """Trainer version of the newest batch formed for `model` (-1: none yet)."""
        return int(self.get(State.batch_version(model), -1))

    def versioned_before(self, version: int) -> list[str]:
        """Fields of per-version entries (eval marks, manifests, checkpoints) older than `version`."""
        return [name for name in self if (found := _versioned(name)) and found[1] < version]


@functools.lru_cache(maxsize=4096)
def _versioned(name: str) -> tuple[Family, int] | None:
    """The family and version of a per-version field's name; None for any other field. (Cached: the
    dataflow looks through the ~150 fields of the state at every step, and they change a few at a time.)"""
    for family in VERSIONED:
        args = family.parse(name)
        if args and args[-1].isdigit():
            return family, int(args[-1])
    return None


async def read_state(bus: Bus) -> RunState:
    return state_of(await bus.call(lambda: bus.redis.hgetall(bus.keys.state)))


def state_of(raw: dict[bytes, bytes]) -> RunState:
    """The snapshot of the state hash whose HGETALL reply is `raw`."""
    return RunState({k.decode(): v.decode() for k, v in raw.items()})


async def recorded_versions(bus: Bus, models: Collection[str]) -> dict[str, tuple[int, str | None]]:
    """Model -> (trainer version, incarnation) as the dataflow recorded them, for models that have one."""
    models = list(models)
    if not models:
        return {}
    names = [name for m in models for name in (State.version(m), State.incarnation(m))]
    values = await bus.call(lambda: bus.redis.hmget(bus.keys.state, names))
    out = {}
    for i, model in enumerate(models):
        version, incarnation = values[2 * i], values[2 * i + 1]
        if version is not None:
            out[model] = (int(version), incarnation and incarnation.decode())
    return out


async def last_notice(bus: Bus) -> int:
    """The last version announced to the RaaS pool (-1: none yet)."""
    value = await bus.call(lambda: bus.redis.hget(bus.keys.state, State.notice))
    return -1 if value is None else int(value)

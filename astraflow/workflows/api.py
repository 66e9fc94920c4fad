"""The workflow and reward APIs: what a user writes, registered by name or found as `module:Name`."""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from astraflow.engines.base import Engine, SamplingParams
from astraflow.messages import Trajectory

WORKFLOWS: dict[str, type[RolloutWorkflow]] = {}
REWARDS: dict[str, Callable[..., float]] = {}
INLINE_REWARDS: set[str] = set()
"""Rewards cheap and safe enough to run in the worker's event loop (no process round trip)."""


@dataclass
class EpisodeResult:
    """What one episode produced: one trajectory per policy that acted in it."""

    trajectories: list[Trajectory]


@dataclass
class WorkflowContext:
    """What a RaaS hands a workflow: tokenizers and sampling per model, the reward runner, options."""

    tokenizers: Mapping[str, Any]
    sampling: SamplingParams
    rewards: Any
    """A RewardRunner: `await rewards.score(name, prompt, completion, sample) -> (reward, error)`."""
    options: dict[str, Any] = field(default_factory=dict)
    """The recipe's `raas.workflow_options`."""


class RolloutWorkflow(ABC):
    """One kind of episode. Instances are shared by every concurrent episode of a worker: keep no state
    per episode on `self`."""

    def __init__(self, ctx: WorkflowContext) -> None:
        self.ctx = ctx

    @abstractmethod
    async def run_episode(
        self, engines: Mapping[str, Engine], sample: dict[str, Any]
    ) -> EpisodeResult | None:
        """Run one episode of `sample`; None means it produced nothing worth training on."""


def workflow(name: str):
    """Class decorator: register a RolloutWorkflow under `name`."""

    def register(cls: type[RolloutWorkflow]) -> type[RolloutWorkflow]:
        WORKFLOWS[name] = cls
        return cls

    return register


def reward(name: str, inline: bool = False):
    """Function decorator: register `fn(prompt, completion, **sample) -> float` under `name`.

    `inline=True` only for code that cannot block, hang or crash (a string comparison): it then runs in
    the worker itself. Everything else runs in the reward process pool, with a timeout."""

    def register(fn: Callable[..., float]) -> Callable[..., float]:
        REWARDS[name] = fn
        if inline:
            INLINE_REWARDS.add(name)
        return fn

    return register


def resolve_workflow(name: str) -> type[RolloutWorkflow]:
    """A registered workflow, or `package.module:Class` imported from the user's code."""
    _load_builtins()
    return _resolve(name, WORKFLOWS, "workflow")


def resolve_reward(name: str) -> Callable[..., float]:
    _load_builtins()
    return _resolve(name, REWARDS, "reward")


def _resolve(name: str, registry: dict, kind: str):
    if name in registry:
        return registry[name]
    module, sep, attr = name.partition(":")
    if not sep:
        raise ValueError(
            f"unknown {kind}: {name!r} (registered: {', '.join(sorted(registry))}; or give module:Name)"
        )
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load {kind} {name!r}: {e}") from None


def _load_builtins() -> None:
    for module in ("rewards", "rlvr", "multi_turn", "solve_verify"):
        importlib.import_module(f"astraflow.workflows.{module}")

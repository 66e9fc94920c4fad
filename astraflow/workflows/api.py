"""The workflow and reward APIs: what a user writes, registered by name or found as `module:Name`."""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from astraflow.engines.base import Engine, SamplingParams
from astraflow.errors import DecodeError
from astraflow.messages import Trajectory

WORKFLOWS: dict[str, type[RolloutWorkflow]] = {}
REWARDS: dict[str, Callable[..., float]] = {}
INLINE_REWARDS: set[str] = set()
"""Rewards cheap and safe enough to run in the worker's event loop (no process round trip)."""
TOOL_FREE_WORKFLOWS: set[str] = set()
"""Registered workflows that run no tool (no code in the tool sandbox); any other may."""
TOOL_REWARDS: set[str] = set()
"""Registered rewards that run code in the tool sandbox."""


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
    endpoint: Any = None
    """The RaaS's OpenAI-compatible endpoint (`agents.server.OpenAIEndpoint`) with `raas.openai_api`,
    else None: what the `agent` workflow points its programs at."""


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


def workflow(name: str, tools: bool = True):
    """Class decorator: register a RolloutWorkflow under `name`; `tools=False` for one that never runs a
    tool (a worker running only such workflows needs no sandbox)."""

    def register(cls: type[RolloutWorkflow]) -> type[RolloutWorkflow]:
        WORKFLOWS[name] = cls
        if not tools:
            TOOL_FREE_WORKFLOWS.add(name)
        return cls

    return register


def reward(name: str, inline: bool = False, tools: bool = False):
    """Function decorator: register `fn(prompt, completion, **sample) -> float` under `name`.

    `inline=True` only for code that cannot block, hang or crash (a string comparison): it then runs in
    the worker itself. Everything else runs in the reward process pool, with a timeout. `tools=True` for
    one that runs code in the tool sandbox."""

    def register(fn: Callable[..., float]) -> Callable[..., float]:
        REWARDS[name] = fn
        if inline:
            INLINE_REWARDS.add(name)
        if tools:
            TOOL_REWARDS.add(name)
        return fn

    return register


def runs_tools(workflow: str, options: Mapping[str, Any]) -> bool:
    """Whether a worker running `workflow` with these `workflow_options` runs tools as the recipe says: its
    workflow is not one registered tool-free (a user's `module:Name` may run any), or its reward is one
    that runs code. (A dataset row may still name another reward: `sandbox.run_python` refuses that call
    where tools cannot be sandboxed.)"""
    _load_builtins()
    reward = options.get("reward")
    return workflow not in TOOL_FREE_WORKFLOWS or (isinstance(reward, str) and reward in TOOL_REWARDS)


class UnknownName(DecodeError, ValueError):
    """A reward or workflow that is neither registered nor named in the recipe: an entry naming it can never
    run (it is dead-lettered), and nothing it names is imported."""


def resolve_workflow(name: str, allowed: Collection[str] = ()) -> type[RolloutWorkflow]:
    """A registered workflow, or a `package.module:Class` of the user's that `allowed` (the recipe) names."""
    _load_builtins()
    return _resolve(name, WORKFLOWS, "workflow", allowed)


def resolve_reward(name: str, allowed: Collection[str] = ()) -> Callable[..., float]:
    """A registered reward, or a `package.module:function` of the user's that `allowed` (the recipe) names."""
    _load_builtins()
    return _resolve(name, REWARDS, "reward", allowed)


def reward_name(sample: Mapping[str, Any], options: Mapping[str, Any]) -> str:
    """The reward that scores `sample`: the row's `reward` when it is a string (a number there is the row's
    data, not a name), else the recipe's `workflow_options.reward`, else exact_match."""
    named = sample.get("reward")
    if isinstance(named, str) and named:
        return named
    return options.get("reward") or "exact_match"


def check_row_rewards(rows: Iterable[Mapping[str, Any]], allowed: Collection[str]) -> None:
    """At load time: ValueError for the first row whose `reward` names `module:Name` code the recipe does
    not name, rather than a dead letter per group. (A plain name may be registered by the user's module,
    which only the RaaS imports: the RaaS checks those.)"""
    for i, row in enumerate(rows):
        name = row.get("reward")
        if isinstance(name, str) and ":" in name and name not in allowed:
            raise ValueError(
                f"dataset row {i}: reward {name!r} is not registered or named in the recipe "
                "(name it in raas.allowed_code)"
            )


def _resolve(name: str, registry: dict, kind: str, allowed: Collection[str]):
    """Data (a prompt group, a dataset row) only picks among names; the recipe alone picks code."""
    if name in registry:
        return registry[name]
    if name not in allowed:
        raise UnknownName(
            f"{kind} {name!r} is not registered or named in the recipe (registered: "
            f"{', '.join(sorted(registry))}; name a module:Name in raas.allowed_code)"
        )
    return load(name, kind)


def load(ref: str, kind: str):
    """Import `module:attr`; only for references the recipe or this process chose, never for data's."""
    module, sep, attr = ref.partition(":")
    if not sep:
        raise ValueError(f"cannot load {kind} {ref!r}: not module:Name")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load {kind} {ref!r}: {e}") from None


def _load_builtins() -> None:
    for module in (
        "rewards",
        "rlvr",
        "multi_turn",
        "solve_verify",
        "actor_verify",
        "plan_solve",
        "route",
        "spawn",
        "code",
        "agent",
    ):
        importlib.import_module(f"astraflow.workflows.{module}")

"""`actor_and_verify`: an actor answers, a verifier judges the answer; both are rewarded.

Unlike `solve_and_verify` the verifier may be the actor itself (self-verification: one policy, two
trajectories per episode) or another policy. The actor is rewarded by the task's reward (correctness); the
verifier by whether its verdict agrees with the ground truth.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from astraflow.engines.base import Engine
from astraflow.workflows.api import EpisodeResult, RolloutWorkflow, workflow
from astraflow.workflows.solve_verify import answer_then_judge


@workflow("actor_and_verify")
class ActorAndVerify(RolloutWorkflow):
    """Options: `actor_model` (default: the group's first policy), `verifier_model` (default: the group's
    second policy, else the actor), and those of `solve_and_verify` (`verify_template`, `verify_tokens`,
    `verify_yes`, `verify_no`, `chat`, `reward`)."""

    async def run_episode(self, engines: Mapping[str, Engine], sample: dict[str, Any]) -> EpisodeResult:
        models = list(engines)
        actor = self.ctx.options.get("actor_model", models[0])
        others = [m for m in models if m != actor]
        verifier = self.ctx.options.get("verifier_model", others[0] if others else actor)
        return await answer_then_judge(self.ctx, engines, sample, actor, verifier)

"""`solve_and_verify`: two policies trained together. A solver answers; a verifier judges that answer.

The solver is rewarded by the task's reward; the verifier by whether its verdict ("yes"/"no") matches
the truth. The group's `models` name them: [solver, verifier]. Each trajectory carries its own model id.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from astraflow.engines.base import Engine, GenerateRequest
from astraflow.workflows.api import (
    EpisodeResult,
    RolloutWorkflow,
    WorkflowContext,
    reward_name,
    workflow,
)
from astraflow.workflows.rlvr import encode_prompt, trajectory


def verdict_reward(verdict: str, solved: bool, yes: str = "y", no: str = "n") -> float:
    """1.0 when the verifier said yes to a right answer or no to a wrong one; 0.0 otherwise (or unclear).

    A verdict says yes when it starts with `yes` (case-insensitive), no when it starts with `no`.
    """
    said = verdict.strip().lower()
    if said.startswith(yes.lower()):
        return 1.0 if solved else 0.0
    if said.startswith(no.lower()):
        return 0.0 if solved else 1.0
    return 0.0


async def answer_then_judge(
    ctx: WorkflowContext, engines: Mapping[str, Engine], sample: dict[str, Any], solver: str, verifier: str
) -> EpisodeResult:
    """`solver` answers `sample`, `verifier` judges that answer (they may be the same policy): the solver's
    trajectory is rewarded by the task's reward, the verifier's by `verdict_reward`."""
    opts = ctx.options
    s_engine, v_engine = engines[solver], engines[verifier]
    s_tok, v_tok = ctx.tokenizers[solver], ctx.tokenizers[verifier]
    text, s_ids = encode_prompt(s_tok, sample, bool(opts.get("chat")))
    s_resp = await s_engine.generate(GenerateRequest(s_ids, ctx.sampling))
    answer = s_tok.decode(s_resp.token_ids, skip_special_tokens=True).strip()
    name = reward_name(sample, opts)
    s_reward, s_error = await ctx.rewards.score(name, text, answer, sample, s_ids, s_resp.token_ids)

    question = str(opts.get("verify_template", "{prompt}{answer}?")).format(
        prompt=sample["prompt"], answer=answer
    )
    _, v_ids = encode_prompt(v_tok, {"prompt": question}, bool(opts.get("chat")))
    params = dataclasses.replace(ctx.sampling, max_new_tokens=int(opts.get("verify_tokens", 2)))
    v_resp = await v_engine.generate(GenerateRequest(v_ids, params))
    verdict = v_tok.decode(v_resp.token_ids, skip_special_tokens=True)
    yes, no = str(opts.get("verify_yes", "y")), str(opts.get("verify_no", "n"))
    v_reward = verdict_reward(verdict, s_reward >= 1.0, yes, no) if s_error is None else 0.0
    v_error = None if s_error is None else f"solver's reward failed: {s_error}"
    return EpisodeResult(
        [
            trajectory(solver, s_ids, s_resp, s_reward, s_error),
            trajectory(verifier, v_ids, v_resp, v_reward, v_error),
        ]
    )


@workflow("solve_and_verify")
class SolveAndVerify(RolloutWorkflow):
    """Options: `verify_template` ("{prompt}{answer}?"), `verify_tokens` (2), `verify_yes` ("y") and
    `verify_no` ("n") (what a verdict starts with: "1"/"0" for a digits-only vocabulary), `chat`, `reward`,
    `solver_model` and `verifier_model` (policies of run.models; default the group's first two)."""

    async def run_episode(self, engines: Mapping[str, Engine], sample: dict[str, Any]) -> EpisodeResult:
        opts = self.ctx.options
        if len(engines) < 2:
            raise ValueError("solve_and_verify needs two models: [solver, verifier]")
        first, second = list(engines)[:2]
        solver, verifier = opts.get("solver_model", first), opts.get("verifier_model", second)
        return await answer_then_judge(self.ctx, engines, sample, solver, verifier)

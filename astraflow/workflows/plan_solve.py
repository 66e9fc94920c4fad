"""`plan_and_solve`: a planner policy writes a plan; the solver's prompt is conditioned on it.

Both are trained on the solver's outcome: the solver's trajectory gets the task's reward, and so does the
planner's (a plan is as good as the solution it led to). Planner and solver may be the same policy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from astraflow.engines.base import Engine, GenerateRequest
from astraflow.workflows.api import EpisodeResult, RolloutWorkflow, reward_name, workflow
from astraflow.workflows.rlvr import encode_prompt, trajectory


@workflow("plan_and_solve")
class PlanAndSolve(RolloutWorkflow):
    """Options: `planner_model` (default: the group's first policy), `solver_model` (default: the group's
    second policy, else the planner), `plan_template` ("{prompt}\\nPlan:"), `plan_tokens` (16),
    `solve_template` ("{plan}\\n{prompt}"), `chat`, `reward`."""

    async def run_episode(self, engines: Mapping[str, Engine], sample: dict[str, Any]) -> EpisodeResult:
        opts, models = self.ctx.options, list(engines)
        planner = opts.get("planner_model", models[0])
        solver = opts.get("solver_model", next((m for m in models if m != planner), planner))
        chat = bool(opts.get("chat"))
        p_tok, s_tok = self.ctx.tokenizers[planner], self.ctx.tokenizers[solver]

        ask = str(opts.get("plan_template", "{prompt}\nPlan:")).format(**sample)
        _, p_ids = encode_prompt(p_tok, {"prompt": ask}, chat)
        params = dataclasses.replace(self.ctx.sampling, max_new_tokens=int(opts.get("plan_tokens", 16)))
        p_resp = await engines[planner].generate(GenerateRequest(p_ids, params))
        plan = p_tok.decode(p_resp.token_ids, skip_special_tokens=True).strip()

        task = str(opts.get("solve_template", "{plan}\n{prompt}")).format(**{**sample, "plan": plan})
        text, s_ids = encode_prompt(s_tok, {"prompt": task}, chat)
        s_resp = await engines[solver].generate(GenerateRequest(s_ids, self.ctx.sampling))
        answer = s_tok.decode(s_resp.token_ids, skip_special_tokens=True)
        name = reward_name(sample, opts)
        score, error = await self.ctx.rewards.score(name, text, answer, sample, s_ids, s_resp.token_ids)
        return EpisodeResult(
            [
                trajectory(planner, p_ids, p_resp, score, error),
                trajectory(solver, s_ids, s_resp, score, error),
            ]
        )

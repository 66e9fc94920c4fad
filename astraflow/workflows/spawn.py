"""`spawn`: an episode that starts sub-episodes and collects their results.

The parent policy writes `<spawn>question</spawn>` calls; each call starts a sub-episode of
`sub_workflow` (any registered workflow, `rlvr` by default) on `sub_model` (the parent or another
policy), all of one turn's calls concurrently. Each sub-episode's answer comes back to the parent as
`<result>...</result>` tokens that no policy produced (loss mask 0, version -1), and the parent goes on
until a turn without a call. The parent's last turn is scored by the task's reward.

Every sub-episode's trajectories are part of the episode and trained too, exactly as their workflow
recorded them: each token keeps the version of the weights that sampled it, whichever policy and
whenever (a load between the parent's and a sub-episode's turns shows in the versions). They are rewarded
with the parent's reward (`sub_credit: parent`, their help is judged by the outcome) or keep their own
workflow's reward (`sub_credit: own`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from astraflow.engines.base import Engine, GenerateRequest
from astraflow.messages import Trajectory
from astraflow.workflows.api import EpisodeResult, RolloutWorkflow, resolve_workflow, reward_name, workflow
from astraflow.workflows.rlvr import encode_prompt
from astraflow.workflows.transcript import Transcript, cut_after_calls

SPAWN_CALL = re.compile(r"<spawn>(.*?)</spawn>", re.DOTALL)


def answer_of(tokenizer: Any, traj: Trajectory) -> str:
    """The text of the trajectory's last sampled span (its policy's final turn)."""
    mask = traj.loss_mask.tolist()
    end = len(mask)
    while end and not mask[end - 1]:
        end -= 1
    start = end
    while start and mask[start - 1]:
        start -= 1
    return tokenizer.decode(traj.token_ids[start:end].tolist(), skip_special_tokens=True).strip()


@workflow("spawn")
class Spawn(RolloutWorkflow):
    """Options: `parent_model` (default: the group's first policy), `sub_model` (default: the parent),
    `sub_workflow` (rlvr; a `module:Name` here is the recipe's choice), `sub_options` (options of the
    sub-episodes' workflow, over these), `sub_credit` (parent | own), `max_spawns` (4 per turn),
    `max_turns` (3), `spawn_depth` (1: sub-episodes that are spawns themselves start none), `chat`,
    `reward`."""

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self._sub: RolloutWorkflow | None = None
        if ctx.options.get("sub_credit", "parent") not in ("parent", "own"):
            raise ValueError(f"spawn: sub_credit {ctx.options['sub_credit']!r} is neither parent nor own")

    def sub_workflow(self) -> RolloutWorkflow:
        """Built on first use (a spawn of spawns builds one level at a time)."""
        if self._sub is None:
            opts = self.ctx.options
            name = str(opts.get("sub_workflow", "rlvr"))
            depth = int(opts.get("spawn_depth", 1)) - 1
            options = {**opts, **opts.get("sub_options", {}), "spawn_depth": depth}
            cls = resolve_workflow(name, allowed={name})  # the option is the recipe's, never the data's
            self._sub = cls(dataclasses.replace(self.ctx, options=options))
        return self._sub

    async def run_episode(self, engines: Mapping[str, Engine], sample: dict[str, Any]) -> EpisodeResult:
        opts = self.ctx.options
        parent = opts.get("parent_model", next(iter(engines)))
        sub_model = opts.get("sub_model", parent)
        sub_engines = {sub_model: engines[sub_model], **engines}  # the sub-episode's first policy
        tok = self.ctx.tokenizers[parent]
        limit = int(opts.get("max_spawns", 4)) if int(opts.get("spawn_depth", 1)) > 0 else 0
        text, prompt_ids = encode_prompt(tok, sample, bool(opts.get("chat")))
        record, subs = Transcript(prompt_ids), []
        final, final_ids, finish = "", [], "length"
        for _ in range(int(opts.get("max_turns", 3))):
            resp = await engines[parent].generate(GenerateRequest(list(record.ids), self.ctx.sampling))
            k, calls = cut_after_calls(tok, resp.token_ids, SPAWN_CALL, limit)
            final_ids, finish = record.sampled(resp, k), resp.finish_reason
            final = tok.decode(final_ids, skip_special_tokens=True)
            if not calls:
                break
            results = await asyncio.gather(
                *[self.sub_workflow().run_episode(sub_engines, {"prompt": c.strip()}) for c in calls]
            )
            answers = []
            for result in results:
                done = result.trajectories if result else []
                subs += done
                answers.append(answer_of(self.ctx.tokenizers[sub_model], done[0]) if done else "")
            shown = "".join(f"<result>{a}</result>" for a in answers)
            record.observed(tok.encode(f"\n{shown}\n", add_special_tokens=False))
        name = reward_name(sample, opts)
        score, error = await self.ctx.rewards.score(name, text, final, sample, prompt_ids, final_ids)
        if opts.get("sub_credit", "parent") == "parent":  # checked at start: parent or own
            subs = [dataclasses.replace(t, reward=score, error=t.error or error) for t in subs]
        return EpisodeResult([record.trajectory(parent, score, finish, error), *subs])

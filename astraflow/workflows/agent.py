"""`agent`: the user's own agent program, written against the OpenAI API, run once per episode.

The program calls the RaaS's OpenAI-compatible endpoint (`raas.openai_api`) with a key that opens this
episode only; every call is recorded token for token (`agents.recording`) and the calls become the
episode's trajectories (`agent_trajectories`: merged where a prompt extends the previous turn). The
reward is what the program returns (or prints, for a command), or a registered verifier's score of the
last reply when the recipe's `reward` option or the sample names one.

A program that fails is a scored failure (reward 0.0 and the reason as the trajectories' error, so they
are not trained on), never a crash of the worker: it raised or exited non-zero, made no call, ran past
`timeout_s`, returned a reward that is not a finite number, or called after its episode had ended.

Each trajectory reports the metrics `tool_call` (1.0 when a reply of the episode carried tool calls) and
`calls` (how many calls the episode made).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import numpy as np

from astraflow.agents.programs import CommandAgent, FunctionAgent, ProgramFailed, printed_reward, reward_of
from astraflow.agents.recording import Episode
from astraflow.engines.base import Engine
from astraflow.errors import ConfigError, describe
from astraflow.messages import Trajectory
from astraflow.workflows.agent_sandbox import SandboxedCommand
from astraflow.workflows.agent_trajectories import trajectories
from astraflow.workflows.api import (
    EpisodeResult,
    RolloutWorkflow,
    WorkflowContext,
    load,
    reward_name,
    workflow,
)


@workflow("agent")
class Agent(RolloutWorkflow):
    """Options: `agent` (`module:function`, an async function of an `openai.AsyncOpenAI` client and the
    sample) or `command` (a command line or argv list; `python` is the RaaS's interpreter) with
    `command_env` (extra environment variables), `sandbox` (run it in the tool sandbox: `agent_sandbox`)
    with `sandbox_dirs` (directories its root shows, read-only) and `sandbox_disk_mb` (64); `timeout_s`
    (300) per episode; `discount` (1.0) per trajectory before the last; `reward` (a registered verifier
    that scores instead of the program)."""

    def __init__(self, ctx: WorkflowContext) -> None:
        super().__init__(ctx)
        if ctx.endpoint is None:
            raise ConfigError(
                "workflow agent needs the RaaS's OpenAI-compatible endpoint: raas.openai_api: true"
            )
        opts = ctx.options
        agent, command = opts.get("agent"), opts.get("command")
        if bool(agent) == bool(command):
            raise ConfigError(
                "workflow agent needs one of workflow_options.agent (module:function) or .command"
            )
        if opts.get("sandbox") and not command:
            raise ConfigError("workflow agent: `sandbox` runs a `command` (a function runs in the RaaS)")
        self.program = _program(agent, command, ctx.endpoint, opts)
        self.timeout_s = float(opts.get("timeout_s", 300))
        self.discount = float(opts.get("discount", 1.0))

    async def run_episode(self, engines: Mapping[str, Engine], sample: dict[str, Any]) -> EpisodeResult:
        endpoint, opts = self.ctx.endpoint, self.ctx.options
        verified = bool(opts.get("reward")) or isinstance(sample.get("reward"), str)
        episode = endpoint.episodes.open(list(engines))
        reward, error = 0.0, None
        try:
            result = await asyncio.wait_for(
                self.program.run(endpoint.base_url, episode.key, sample), self.timeout_s
            )
            if not verified:
                got = printed_reward(result, True) if isinstance(self.program, CommandAgent) else result
                reward = reward_of(got, True)
        except TimeoutError:
            error = f"the agent ran past timeout_s ({self.timeout_s:g} s)"
        except ProgramFailed as e:
            error = str(e)
        except Exception as e:  # the user's program raised: its episode fails, the worker goes on
            error = f"the agent raised {describe(e)}"
        finally:
            endpoint.episodes.close(episode)
        if error is None and not episode.calls:
            error = "the agent made no call to the endpoint"
        if error is None and verified:
            reward, error = await self._verify(episode, sample)
        if error is None and (episode.late or episode.in_flight):
            late = episode.late + episode.in_flight
            error = f"the agent called after its episode ended ({late} calls not recorded)"
        return EpisodeResult(self._trajectories(episode, next(iter(engines)), reward, error))

    async def _verify(self, episode: Episode, sample: dict[str, Any]) -> tuple[float, str | None]:
        """The verifier's score of the last reply (its text) against `sample`."""
        last = episode.ordered()[-1]
        tokenizer = self.ctx.tokenizers[last.model]
        prompt = tokenizer.decode(last.prompt_ids, skip_special_tokens=True)
        completion = tokenizer.decode(last.response.token_ids, skip_special_tokens=True)
        name = reward_name(sample, self.ctx.options)
        return await self.ctx.rewards.score(
            name, prompt, completion, sample, last.prompt_ids, last.response.token_ids
        )

    def _trajectories(
        self, episode: Episode, model: str, reward: float, error: str | None
    ) -> list[Trajectory]:
        calls = episode.ordered()
        metrics = {"tool_call": float(any(c.tool_calls for c in calls)), "calls": float(len(calls))}
        if error is not None:
            reward = 0.0
        made = trajectories(calls, reward, self.discount, error, metrics)
        return made or [_empty(model, error or "no call", metrics)]


def _program(agent: str | None, command: Any, endpoint: Any, opts: Mapping[str, Any]) -> Any:
    if agent:
        return FunctionAgent(load(agent, "agent"))
    env = opts.get("command_env")
    if opts.get("sandbox"):
        dirs = opts.get("sandbox_dirs") or []
        return SandboxedCommand(
            command, endpoint.socket_path, env, dirs, int(opts.get("sandbox_disk_mb", 64))
        )
    return CommandAgent(command, env)


def _empty(model: str, error: str, metrics: dict[str, float]) -> Trajectory:
    """A failed episode with no tokens: its reason reaches the run's records, nothing is trained."""
    none = np.zeros(0, np.int32)
    return Trajectory(
        model, none, np.zeros(0, np.float32), np.zeros(0, np.uint8), none, 0.0, "", error, metrics
    )

"""The RaaS worker: prompt groups in, rollout groups out, weights followed from `notices`.

It heartbeats into `raas:<id>`, reads at most its free slots from `prompts`, runs the group's episodes
concurrently through its workflow, and hands the rollout group off atomically with the prompt's ack
(`Runner`: leases renewed while episodes run, entries of dead workers reclaimed, poison dead-lettered).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Mapping

import structlog

from astraflow.engines import Engine, SamplingParams, resolve_type
from astraflow.errors import describe
from astraflow.messages import (
    Heartbeat,
    PromptGroup,
    RolloutGroup,
    decode,
    encode,
)
from astraflow.policies import PolicySettings
from astraflow.raas.follow import NoticeFollower
from astraflow.raas.metrics import BusyClock, Metrics
from astraflow.raas.settings import RaasSettings
from astraflow.streams import Bus, Consumer, Delivery, Out, Runner
from astraflow.streams.connection import cancel_and_wait, raise_if_cancelled
from astraflow.streams.keys import GROUP_RAAS
from astraflow.streams.names import write_heartbeat
from astraflow.weights.receiver import WeightReceiver
from astraflow.workflows.api import (
    RolloutWorkflow,
    WorkflowContext,
    resolve_reward,
    reward_name,
)
from astraflow.workflows.pushed import PushedWorkflows
from astraflow.workflows.rewards import RewardRunner

log = structlog.get_logger(__name__)


@dataclasses.dataclass(frozen=True)
class RaasSetup:
    """What a RaaS worker gets of the run's settings (assembled by `launch.build.raas_setup`)."""

    raas: RaasSettings
    policies: Mapping[str, PolicySettings]
    """Every policy of the run by name, with its effective engine settings (`Settings.policy`)."""
    trained: frozenset[str]
    """The policies trained in this run: the ones whose weights follow the notices."""
    sync: bool
    """Lockstep (`trainer.mode: sync`): a group runs on the weights of its version, no older."""
    named_code: frozenset[str]
    """The `module:Name` code the recipe names, the only code a prompt group may pick by name."""


class RaasWorker:
    def __init__(
        self,
        settings: RaasSetup,
        bus: Bus,
        engines: Mapping[str, Engine],
        worker_id: str,
        tokenizers: Mapping[str, object],
        receivers: Mapping[str, WeightReceiver] | None = None,
    ) -> None:
        self.settings, self.bus, self.engines, self.id = settings, bus, engines, worker_id
        self.receivers = dict(receivers or {})
        self.policies = [settings.policies[m] for m in engines]
        self.trained = settings.trained
        r = settings.raas
        s = r.sampling
        self.allowed = settings.named_code
        sampling = SamplingParams(s.temperature, s.top_p, s.top_k, s.max_new_tokens)
        self.endpoint = None
        if r.openai_api:  # aiohttp only where it is served
            from astraflow.agents.server import OpenAIEndpoint

            self.endpoint = OpenAIEndpoint(engines, tokenizers, sampling, r.openai_host, r.openai_port)
        self.ctx = WorkflowContext(
            tokenizers,
            sampling,
            RewardRunner(r.reward_processes, r.reward_timeout_s, self.allowed, sandbox=r.sandbox),
            dict(r.workflow_options),
            self.endpoint,
        )
        self.metrics = Metrics(r, bus.keys.run, worker_id, engines)
        self.busy = BusyClock()
        self.started_at = time.time()
        self._workflows: dict[tuple, RolloutWorkflow] = {}
        self._pushed = PushedWorkflows(bus, r)
        self.weights = NoticeFollower(bus, engines, self.receivers, self.metrics)
        consumer = Consumer(bus, bus.keys.prompts, GROUP_RAAS, worker_id)
        self.runner = Runner(consumer, self.handle, r.slots, trims=False)  # (the dataflow trims prompts)

    async def run(self, stop: asyncio.Event) -> None:
        """Work until `stop`; then finish within `raas.grace_s`, release the rest, deregister."""
        await self.bus.ensure_group(self.bus.keys.prompts, GROUP_RAAS)  # only what it reads (its ACL user)
        if self.endpoint is not None:
            await self.endpoint.start()
        helpers = [asyncio.create_task(self._heartbeat_loop()), asyncio.create_task(self.weights.run())]
        log.info("raas_started", slots=self.settings.raas.slots, models=list(self.engines))
        try:
            await self.runner.run(stop, drain_s=self.settings.raas.grace_s)
        finally:
            await cancel_and_wait(helpers)
            if self.endpoint is not None:
                await self.endpoint.close()
            for receiver in self.receivers.values():  # no longer a weight source for the others
                await receiver.leave()
            await self.bus.redis.delete(self.bus.keys.raas(self.id))
            self.ctx.rewards.close()
            engines = {m: dict(getattr(e, "stats", {})) for m, e in self.engines.items()}
            reads = dict(self.bus.reader.stats)  # replica reads vs primary fallbacks (redis.replica_url)
            pulls = {m: dict(rx.stats) for m, rx in self.receivers.items()}  # full/delta/relay pulls, bytes
            log.info("raas_stopped", engines=engines, replica_reads=reads, weights=pulls, **self.runner.stats)

    async def handle(self, entry: Delivery) -> list[Out]:
        group = decode(entry.fields, PromptGroup, self.bus.settings.max_entry_bytes)
        flow = await self._workflow(group.workflow, group.sampling)  # refused unless known or pushed
        resolve_reward(reward_name(group.sample, self.ctx.options), self.allowed)
        await self.weights.synced.wait()
        trained = [m for m in group.models if m in self.trained]
        if group.eval_version >= 0 and not await self.weights.at_eval_version(trained, group.eval_version):
            versions = {m: self.engines[m].version for m in trained}
            error = f"eval version {group.eval_version} not loaded: notice {self.weights.noticed}, {versions}"
            log.warning("eval_group_dropped", uid=group.uid, error=error)
            return [self._rollout(group, [], {}, error)]
        if self.settings.sync:  # lockstep: the weights of the group's version, no older
            await self.weights.at_least(trained, group.version)
        engines = {m: self.engines[m] for m in group.models}
        started = time.perf_counter()
        with self.busy.running():
            results = await asyncio.gather(
                *[flow.run_episode(engines, dict(group.sample)) for _ in range(group.n_samples)],
                return_exceptions=True,
            )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors and len(errors) == len(results):
            raise errors[0]  # nothing ran: the entry is retried, then dead-lettered with this reason
        for e in errors:
            log.warning("episode_failed", uid=group.uid, error=describe(e))
        trajectories = [
            t for r in results if r is not None and not isinstance(r, BaseException) for t in r.trajectories
        ]
        failed = sum(t.error is not None for t in trajectories)
        self.metrics.episode(len(results), sum(int(t.loss_mask.sum()) for t in trajectories), failed)
        timings = {"episodes_s": time.perf_counter() - started}
        return [
            self._rollout(
                group, trajectories, timings, None if trajectories else "no episode produced a trajectory"
            )
        ]

    def _rollout(self, group: PromptGroup, trajectories: list, timings: dict, error: str | None) -> Out:
        rollout = RolloutGroup(
            uid=group.uid,
            raas=self.id,
            version=group.version,
            trajectories=trajectories,
            timings=timings,
            error=error,
            models=list(group.models),
            eval_version=group.eval_version,
            eval_dataset=group.eval_dataset,
        )
        return Out(self.bus.keys.rollouts, encode(rollout), f"rollout:{group.uid}")

    async def _workflow(self, name: str, sampling: Mapping[str, float]) -> RolloutWorkflow:
        """The workflow `name` (registered, the recipe's, else pushed to the run if accepted), with the
        group's `sampling` over the RaaS's (an unknown field raises: the entry is dead-lettered)."""
        key = (name, tuple(sorted(sampling.items())))
        if key not in self._workflows:
            s = self.ctx.sampling
            params = dataclasses.replace(s, **{k: type(getattr(s, k))(v) for k, v in sampling.items()})
            ctx = dataclasses.replace(self.ctx, sampling=params)
            self._workflows[key] = (await self._pushed.resolve(name, self.allowed))(ctx)
        return self._workflows[key]

    async def _heartbeat_loop(self) -> None:
        key, period = self.bus.keys.raas(self.id), self.settings.raas.heartbeat_ms
        unowned = False
        while True:
            beat = Heartbeat(
                uid=self.id,
                region=self.settings.raas.region,
                capacity=self.settings.raas.slots,
                in_flight=self.runner.held,
                versions={m: e.version for m, e in self.engines.items()},
                endpoint=next(iter(self.receivers.values())).server.endpoint if self.receivers else None,
                started_at=self.started_at,
                updated_at=time.time(),
                engine=", ".join(f"{resolve_type(p.engine)}:{p.engine.model}" for p in self.policies),
                generating_s=round(self.busy.seconds(), 3),
                groups=self.runner.handed_off,
            )
            self.metrics.slots(self.runner.held, self.settings.raas.slots)
            try:  # only while this process holds its name: no other process can beat for it
                if not await write_heartbeat(self.bus, self.id, encode(beat), 3 * period) and not unowned:
                    unowned = True
                    log.warning("heartbeat_not_written", key=key, reason="this process holds no name")
            except Exception as e:  # a missed beat is not fatal; the next one may get through
                raise_if_cancelled()
                log.warning("heartbeat_failed", error=describe(e))
            await asyncio.sleep(period / 1000)

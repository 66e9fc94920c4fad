"""The RaaS worker: prompt groups in, rollout groups out, weights followed from `notices`.

It heartbeats into `raas:<id>`, reads at most its free slots from `prompts`, runs the group's episodes
concurrently through its workflow, and hands the rollout group off atomically with the prompt's ack
(`Runner`: leases renewed while episodes run, entries of dead workers reclaimed, poison dead-lettered).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import Mapping
from contextlib import nullcontext
from pathlib import Path

import structlog

from astraflow.engines import Engine, SamplingParams, resolve_type
from astraflow.errors import WeightIntegrityError
from astraflow.messages import (
    Heartbeat,
    PromptGroup,
    RolloutGroup,
    VersionNotice,
    WeightManifest,
    decode,
    encode,
)
from astraflow.policies import PolicySettings
from astraflow.raas.metrics import BusyClock, Metrics
from astraflow.raas.settings import RaasSettings
from astraflow.streams import Bus, Consumer, Entry, Out, Runner
from astraflow.streams.connection import cancel_and_wait, raise_if_cancelled
from astraflow.streams.keys import GROUP_RAAS
from astraflow.weights.files import verify_checkpoint
from astraflow.weights.publisher import newest_published
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
        self.ctx = WorkflowContext(
            tokenizers,
            SamplingParams(s.temperature, s.top_p, s.top_k, s.max_new_tokens),
            RewardRunner(r.reward_processes, r.reward_timeout_s, self.allowed),
            dict(r.workflow_options),
        )
        self.metrics = Metrics(r.metrics_port)
        self.busy = BusyClock()
        self.started_at = time.time()
        self._workflows: dict[tuple, RolloutWorkflow] = {}
        self._pushed = PushedWorkflows(bus, r)
        self._incarnations: dict[str, str] = {}
        """Model -> trainer incarnation of the loaded weights (from the notices)."""
        self._loads = asyncio.Lock()
        self._loaded = asyncio.Condition()  # notified after every weight load
        self._synced = asyncio.Event()  # cleared while an eval notice is being loaded
        self._synced.set()
        self.runner = Runner(Consumer(bus, bus.keys.prompts, GROUP_RAAS, worker_id), self.handle, r.slots)

    async def run(self, stop: asyncio.Event) -> None:
        """Work until `stop`; then finish within `raas.grace_s`, release the rest, deregister."""
        await self.bus.ensure_group(self.bus.keys.prompts, GROUP_RAAS)  # only what it reads (its ACL user)
        helpers = [asyncio.create_task(self._heartbeat_loop()), asyncio.create_task(self._follow_notices())]
        log.info("raas_started", slots=self.settings.raas.slots, models=list(self.engines))
        try:
            await self.runner.run(stop, drain_s=self.settings.raas.grace_s)
        finally:
            await cancel_and_wait(helpers)
            await self.bus.redis.delete(self.bus.keys.raas(self.id))
            self.ctx.rewards.close()
            engines = {m: dict(getattr(e, "stats", {})) for m, e in self.engines.items()}
            reads = dict(self.bus.reader.stats)  # replica reads vs primary fallbacks (redis.replica_url)
            pulls = {m: dict(rx.stats) for m, rx in self.receivers.items()}  # full/delta/relay pulls, bytes
            log.info("raas_stopped", engines=engines, replica_reads=reads, weights=pulls, **self.runner.stats)

    async def handle(self, entry: Entry) -> list[Out]:
        group = decode(entry.fields, PromptGroup, self.bus.settings.max_entry_bytes)
        flow = await self._workflow(group.workflow, group.sampling)  # refused unless known or pushed
        resolve_reward(reward_name(group.sample, self.ctx.options), self.allowed)
        await self._synced.wait()
        # An eval group runs on exactly its version (the barrier holds later notices until it is scored);
        # lockstep: the weights of the group's version, no older.
        floor = (
            group.eval_version if group.eval_version >= 0 else group.version if self.settings.sync else None
        )
        if floor is not None:
            async with self._loaded:
                await self._loaded.wait_for(
                    lambda: all(self.engines[m].version >= floor for m in group.models if m in self.trained)
                )
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
            log.warning("episode_failed", uid=group.uid, error=repr(e))
        trajectories = [
            t for r in results if r is not None and not isinstance(r, BaseException) for t in r.trajectories
        ]
        failed = sum(t.error is not None for t in trajectories)
        self.metrics.episode(len(results), sum(int(t.loss_mask.sum()) for t in trajectories), failed)
        rollout = RolloutGroup(
            uid=group.uid,
            raas=self.id,
            version=group.version,
            trajectories=trajectories,
            timings={"episodes_s": time.perf_counter() - started},
            error=None if trajectories else "no episode produced a trajectory",
            models=list(group.models),
            eval_version=group.eval_version,
            eval_dataset=group.eval_dataset,
        )
        return [Out(self.bus.keys.rollouts, encode(rollout), f"rollout:{group.uid}")]

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
            try:
                async with self.bus.redis.pipeline(transaction=True) as pipe:
                    await pipe.hset(key, mapping=encode(beat)).pexpire(key, 3 * period).execute()
            except Exception as e:  # a missed beat is not fatal; the next one may get through
                raise_if_cancelled()
                log.warning("heartbeat_failed", error=repr(e))
            await asyncio.sleep(period / 1000)

    async def _follow_notices(self) -> None:
        """Apply the latest notice at start (catching up), then the newest of each batch that arrives
        (notices carry absolute versions: an older one in the same batch has nothing left to load). A
        notice whose load failed is retried at once with each model's newest published version (a
        trainer ahead of the others serves the noticed one no longer once it has published the next),
        then again while no newer notice arrives (its manifest may name a trainer that restarted since,
        and the restarted one rewrites it with its own endpoint)."""
        stream, cursor, failed = self.bus.keys.notices, None, None
        while True:
            try:
                if cursor is None:
                    entries = await self.bus.read_only(lambda r: r.xrevrange(stream, count=1))
                else:
                    reply = await self.bus.read_only(
                        functools.partial(_read_notices, stream, cursor, self.bus.settings.block_ms),
                        blocking=True,
                    )
                    entries = reply[0][1] if reply else []
            except Exception as e:  # Redis away or refusing: keep following, it is the weights' only path
                raise_if_cancelled()
                log.warning("notices_unreachable", error=repr(e))
                await asyncio.sleep(0.5)
                continue
            cursor = entries[-1][0].decode() if entries else (cursor or "0-0")
            retry = entries[-1][1] if entries else failed
            if retry is not None:
                ok = await self._apply(retry) or await self._apply(retry, newest=True)
                failed = None if ok else retry

    async def _load(self, model: str, engine: Engine, version: int, notice: VersionNotice) -> bool:
        """Get the version's weights (pulled and verified while generation goes on), then pause, load,
        resume. A shared checkpoint directory in the notice is loaded instead, once its weights match the
        digest of the version's manifest (WeightIntegrityError otherwise). False: the notice names no
        weights of `model`."""
        started = time.perf_counter()
        receiver, manifest = self.receivers.get(model), notice.manifests.get(model)
        if model in notice.checkpoints:  # no transfer, but no trust either: checked against the manifest
            hold, path = nullcontext(), notice.checkpoints[model]
            await self._verify_checkpoint(path, manifest)
        elif receiver is not None and manifest:
            half = await receiver.sync(manifest, version)
            hold, path = receiver.buffer.reading(half), str(half.dir)  # type: ignore[union-attr]
        else:
            return False
        pulled = time.perf_counter()
        with hold:
            try:
                await engine.pause()
                await engine.load_weights(path, version)
            finally:
                await engine.resume()
        async with self._loaded:
            self._loaded.notify_all()
        self.metrics.loaded(time.perf_counter() - started)
        log.info(
            "weights_loaded",
            model=model,
            version=version,
            pull_s=pulled - started,
            load_s=time.perf_counter() - pulled,
        )
        return True

    async def _verify_checkpoint(self, path: str, manifest_key: str | None) -> None:
        fields = {}
        if manifest_key:
            fields = await self.bus.read_only(lambda r: r.hgetall(manifest_key), fresh=bool)
        if not fields:
            raise WeightIntegrityError(f"checkpoint {path}: no manifest to check it against")
        await asyncio.to_thread(verify_checkpoint, Path(path), decode(fields, WeightManifest))

    async def _apply(self, fields: dict, newest: bool = False) -> bool:
        """Load what the notice names (with `newest`, each model's newest published version where that is
        newer; not for eval notices, which are exact); False when a load failed."""
        try:
            notice = decode(fields, VersionNotice)
        except Exception as e:  # a bad notice must not stop the worker from following the next ones
            log.error("bad_notice", error=repr(e))
            return True
        if newest and not notice.eval:
            notice = await self._with_newest(notice)
        async with self._loads:
            if notice.eval:
                self._synced.clear()
            try:
                for model, version in notice.models.items():
                    engine = self.engines.get(model)
                    incarnation = notice.incarnations.get(model)
                    same = incarnation is None or incarnation == self._incarnations.get(model, incarnation)
                    if engine is None or (version <= engine.version and same):
                        continue  # nothing newer; weights of a dead incarnation are replaced, even by older
                    if await self._load(model, engine, version, notice) and incarnation is not None:
                        self._incarnations[model] = incarnation
            except Exception as e:
                log.error("weights_load_failed", version=notice.version, error=repr(e))
                return False
            finally:
                self._synced.set()
        return True

    async def _with_newest(self, notice: VersionNotice) -> VersionNotice:
        """`notice` with each model's newest published version, where newer than the notice's."""
        models, manifests = dict(notice.models), dict(notice.manifests)
        incarnations = dict(notice.incarnations)
        for model, msg in (await newest_published(self.bus, list(models))).items():
            if msg.version > models[model]:
                models[model], manifests[model] = msg.version, msg.manifest_key
                if msg.incarnation is not None:
                    incarnations[model] = msg.incarnation
        return dataclasses.replace(notice, models=models, manifests=manifests, incarnations=incarnations)


def _read_notices(stream: str, cursor: str, block_ms: int, client):
    return client.xread({stream: cursor}, count=64, block=block_ms)

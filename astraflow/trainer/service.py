"""A trainer process for one policy: batches in, versions out, exactly once across crashes.

Loop: read a batch of `batches:<model>` (own pending ones first, after a restart); skip and acknowledge
one whose uid the restored checkpoint already trained; otherwise train on it and publish the new
version at once. Every `checkpoint_every` versions (and on a clean stop): snapshot the state, then (in
the background, while the next batch trains) write it as a durable checkpoint while its weights go to
the publication buffer; once the checkpoint is durable, acknowledge the batches it holds and announce
the version. So a batch is acknowledged only once its update is durable: after a `kill -9` the
restarted trainer resumes from its last checkpoint, retrains the batches it had not acknowledged, and
publishes the same version numbers again. With `checkpoint_every` 1 every version any RaaS holds is one
the trainer can restore; with more, versions past the last checkpoint die with the trainer, and its
successor (a new incarnation) announces its checkpoint's version again: every RaaS rolls back to it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import structlog

from astraflow.dataflow.batches import BatchReader, Received
from astraflow.errors import describe
from astraflow.streams import Bus
from astraflow.streams.connection import cancel_and_wait, raise_if_cancelled
from astraflow.streams.records import Record, TrainerStep, encode_record
from astraflow.trainer import checkpoint, commands, devices, distributed, lora
from astraflow.trainer.eval_cadence import EvalCadence
from astraflow.trainer.ranks import Ranks
from astraflow.trainer.settings import TrainerSettings
from astraflow.trainer.step import PolicyTrainer
from astraflow.weights import adapters, layout
from astraflow.weights.files import buffer_root
from astraflow.weights.published import newest_published, run_secret
from astraflow.weights.publisher import Adapter, WeightPublisher
from astraflow.weights.settings import WeightsSettings

log = structlog.get_logger(__name__)


@dataclasses.dataclass(frozen=True)
class TrainerSetup:
    """What the trainer of one policy gets of the run's settings (`launch.build.trainer_setup`)."""

    trainer: TrainerSettings
    """The policy's effective trainer settings (`Settings.policy(name).trainer`)."""
    weights: WeightsSettings
    run_name: str
    run_path: Path
    """The run directory: checkpoints go under it unless `trainer.checkpoint_dir` is set."""
    eval_every: int = 0
    """Every this many versions (and version 0) is published as an eval version (`eval.every`; 0 none)."""
    eval_every_s: float = 0.0
    """Also the first version trained this many seconds after the last eval version (`eval.every_s`)."""


class TrainerService:
    def __init__(self, settings: TrainerSetup, bus: Bus, model_name: str) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.settings, self.bus, self.model_name = settings, bus, model_name
        t = self.trainer = settings.trainer
        path = t.model
        if not path:
            raise ValueError(f"no starting weights: set run.models.{model_name}.model or trainer.model")
        self.device = device = devices.resolve(t)  # first: a device this machine lacks fails before loading
        dtype = t.lora.base_dtype if t.lora is not None else "float32"  # the master weights, or the base
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        pad = AutoTokenizer.from_pretrained(path).pad_token_id
        self.rank, self.size = distributed.world()
        self.base = ""
        """LoRA: the digest of the frozen base (`adapters.base_digest`); '' = full fine-tuning."""
        if t.lora is not None:
            model = lora.wrap(model, t.lora)
            self.base = adapters.base_digest(str(path)) if self.rank == 0 else ""
        distributed.prepare(model, t, device, sharded=self.size > 1)  # before the optimizer: it holds shards
        self.policy = PolicyTrainer(model, t, pad_id=pad or 0)
        self.ckpt_root = t.checkpoint_dir or settings.run_path / "checkpoints" / model_name
        self.batches = BatchReader(bus, model_name, f"trainer-{model_name}")
        self.adapter_config = lora.adapter_config(self.policy.model) if self.base else ""
        self.state = checkpoint.TrainerState(base=self.base, adapter_config=self.adapter_config)
        self.publisher: WeightPublisher | None = None
        self._evals = EvalCadence(settings.eval_every, settings.eval_every_s)
        self._unacked: list[Received] = []
        self._committing: asyncio.Task | None = None
        self._wait_s = 0.0  # waiting for a batch since the last step was reported
        dtype, timeout_s = settings.weights.dtype, t.collective_timeout_s
        self.ranks = Ranks(self.policy, device, self.rank, self.size, dtype, timeout_s)
        """Runs each command on every rank (rank 0 decides; the others `follow`)."""
        self.observe: Callable[[list[Record]], None] = lambda records: None
        """Sees each `metrics` entry once written (its Prometheus series: `launch.build`)."""

    def follow(self) -> None:
        """Ranks > 0: execute rank 0's commands until it says stop (`ranks.Ranks.follow`)."""
        self.ranks.follow()

    # -- rank 0 -----------------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        try:
            await self._run(stop)
        finally:
            self.ranks.stop()

    async def _run(self, stop: asyncio.Event) -> None:
        identity = await self.bus.identity()
        self.state.run = identity.nonce
        await self.batches.open()
        latest = checkpoint.latest(self.ckpt_root)
        if latest is not None:
            restored = await asyncio.to_thread(
                checkpoint.load, latest, identity.nonce, self.trainer.adopt_checkpoint, self.base
            )
            self.state = restored[0]
            self.state.adapter_config = self.adapter_config  # as trained from now on (alpha may differ)
            await asyncio.to_thread(self.ranks.all, commands.Restore(*restored))
            log.info("trainer_restored", model=self.model_name, version=self.state.version, path=str(latest))
        secret = await run_secret(self.bus, self.settings.weights)
        state = await asyncio.to_thread(self.ranks.all, commands.PublicationState())
        weights = self.settings.weights
        root = buffer_root(weights, self.settings.run_name, f"trainer-{self.model_name}")
        specs = layout.layout(state, weights.dtype)
        adapter = Adapter(self.base, self.adapter_config) if self.base else None
        self.publisher = WeightPublisher(self.bus, weights, self.model_name, specs, root, secret, adapter)
        # Serve the restored (or initial) version. A durable version is announced at most once (dedup key),
        # so after a crash it is announced again only if the crash came before that - or if the dead
        # trainer announced versions past this checkpoint (`checkpoint_every` > 1): those weights are
        # gone, and announcing this version under the new incarnation rolls every RaaS back to it.
        rollback = await self._announced(self.model_name) > self.state.version
        if rollback:
            log.warning("trainer_rollback", model=self.model_name, version=self.state.version)
        v = self.state.version
        await self.publisher.publish(state, v, self.state.step, eval_=self._eval(v), once=not rollback)
        renew = asyncio.create_task(self._renew_loop())
        try:
            while not stop.is_set() and not self._done():
                waiting = time.perf_counter()
                received = await self.batches.read(1, self.bus.settings.block_ms)
                self._wait_s += time.perf_counter() - waiting
                for r in received:
                    await self._handle(r)
            if self._unacked:  # a clean stop keeps what was trained since the last checkpoint
                await self._commit()
        finally:
            await cancel_and_wait([renew])
            await self._committed()
            await self.publisher.close()
            shutil.rmtree(root, ignore_errors=True)  # shared memory; a crash leaves it to the next start

    async def _announced(self, model: str) -> int:
        """The newest version of `model` published (-1 = none)."""
        newest = (await newest_published(self.bus, [model])).get(model)
        return newest.version if newest is not None else -1

    def _eval(self, version: int) -> bool:
        return self._evals.flag(version)

    def _done(self) -> bool:
        limit = self.trainer.max_steps
        return limit is not None and self.state.version >= limit

    async def _handle(self, received: Received) -> None:
        batch = received.batch
        if self.state.trained(batch.uid, received.id):  # trained before the crash, its ack was lost
            await self._ack([received])
            log.info("batch_already_trained", batch=batch.uid)
            return
        stats = await self._train(received)
        if stats is None:  # set aside: no version, nothing published
            return
        self.state.version += 1
        self.state.step += self.trainer.minibatches
        self.state.add(batch.uid, received.id)
        self._unacked.append(received)
        log.info(
            "trained",
            model=self.model_name,
            version=self.state.version,
            batch=batch.uid,
            loss=round(stats["loss"], 4),
            reward=round(stats["reward_mean"], 3),
        )
        stats["wait_s"], self._wait_s = self._wait_s, 0.0
        await self._metrics(batch.uid, stats)  # before the commit: a step retrained after a crash is
        if self.state.version % self.trainer.checkpoint_every == 0:  # reported again, none lost
            await self._commit()
        else:  # served and announced now; a restart from an older checkpoint rolls it back (see run)
            model_state = await asyncio.to_thread(self.ranks.all, commands.PublicationState())
            v = self.state.version
            await self.publisher.publish(model_state, v, self.state.step, eval_=self._eval(v), once=False)

    async def _train(self, received: Received) -> dict[str, float] | None:
        """Train on `received`; None when it was set aside instead (dead letter, ledger `dead`): it was
        refused (non-finite values or step) or the trainer died during its steps too often.

        A step that raises is recorded against the batch and the exception goes on: the trainer restarts
        from its checkpoint. The step may have been half applied (an earlier minibatch stepped, ranks
        mid-collective), and an exception does not tell bad data from a bad device or a lost rank; the
        data faults known to be deterministic are refused by the step itself without raising. The restart
        costs one retry of a batch that really is bad: after its second death it is set aside at the next
        start (BatchReader.begin).
        """
        why = await self.batches.begin(received)
        if why is None:
            try:
                train = commands.Train(received.batch, self.state.version)
                stats = await asyncio.to_thread(self.ranks.all, train)
            except Exception as e:
                await self.batches.failed(received, f"{type(e).__name__}: {e}")
                raise
            await self.batches.finished(received)
            if self.policy.skipped is None:
                return stats
            why = f"step refused: {self.policy.skipped}"
        await self._set_aside(received, why)
        return None

    async def _set_aside(self, received: Received, reason: str) -> None:
        """Dead-letter a batch that is not trained on; its groups count `dead` in the ledger."""
        status = await self.batches.set_aside(received, reason)
        log.error(
            "batch_set_aside", model=self.model_name, batch=received.batch.uid, reason=reason, status=status
        )

    async def _commit(self) -> None:
        """Snapshot the state; then, while the next batch trains, write it as a durable checkpoint (the
        weights go to the publication buffer meanwhile), acknowledge the batches it holds and announce
        its version (commits stay one at a time, in order)."""
        await self._committed()
        model_state, optim_state = await asyncio.to_thread(self.ranks.all, commands.FullState())
        state = dataclasses.replace(self.state, consumed=list(self.state.consumed))
        entries, self._unacked = self._unacked, []
        rngs = await asyncio.to_thread(self.ranks.all, commands.RngState())
        rest = (self.policy.scheduler.state_dict(), rngs)
        self._committing = asyncio.create_task(self._persist(state, model_state, optim_state, rest, entries))

    async def _persist(self, state, model_state, optim_state, rest, entries: list[Received]) -> None:
        assert self.publisher is not None
        keep = self.trainer.keep_checkpoints
        saved = asyncio.ensure_future(
            asyncio.to_thread(checkpoint.save, self.ckpt_root, state, model_state, optim_state, *rest, keep)
        )
        try:  # the weights go to the buffer meanwhile; served and announced once the checkpoint is durable
            v = state.version
            served = lora.adapter_state(self.policy.model, model_state) if self.base else model_state
            await self.publisher.publish(served, v, state.step, eval_=self._eval(v), durable=saved)
        finally:
            await saved
        await self._ack(entries)

    async def _committed(self) -> None:
        """Until the last commit is done (raises what it raised: the trainer then restarts)."""
        if self._committing is not None:
            task, self._committing = self._committing, None
            await task

    async def _ack(self, received: list[Received]) -> None:
        """Acknowledge batches a durable checkpoint holds (they are not read again)."""
        # Refused: another trainer took it over, or a failover lost its read; either way it is trained again.
        for batch_id in await self.batches.ack(received):
            log.error("batch_ack_refused", model=self.model_name, id=batch_id)

    async def _metrics(self, batch_uid: str, stats: dict[str, float]) -> None:
        record = TrainerStep(self.model_name, self.state.version, batch_uid, time.time(), stats)
        fields, maxlen = encode_record(record), self.bus.settings.capped_maxlen
        await self.bus.call(
            lambda: self.bus.redis.xadd(self.bus.keys.metrics, fields, maxlen=maxlen, approximate=True)
        )
        self.observe([record])

    async def _renew_loop(self) -> None:
        """Keep the leases of held batches (held until a checkpoint covers them)."""
        while True:
            await asyncio.sleep(self.bus.settings.lease_ms / 3000)
            try:
                lost = await self.batches.renew()
            except Exception as e:
                raise_if_cancelled()
                log.warning("lease_renewal_failed", error=describe(e))
                continue
            for batch_id in lost:
                log.error("batch_lease_lost", id=batch_id)

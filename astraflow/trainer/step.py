"""One policy and its optimizer: a training step on one Batch (torch only, no Redis)."""

from __future__ import annotations

import copy
import math
import time
from dataclasses import replace

import numpy as np
import torch

from astraflow.messages import Batch
from astraflow.trainer import devices, losses
from astraflow.trainer.batching import MicroBatch, Sample, micro_batches, samples, split, token_logprobs
from astraflow.trainer.distributed import sync_max, world
from astraflow.trainer.settings import TrainerSettings


class PolicyTrainer:
    """Trains `model` where its parameters are (see `devices.prepare`), in `settings.dtype`."""

    def __init__(self, model, settings: TrainerSettings, pad_id: int = 0) -> None:
        self.model, self.settings, self.pad_id = model, settings, pad_id
        self.device = next(model.parameters()).device
        # Sharded, FSDP2's mixed-precision policy casts (see `distributed.shard`); whole, autocast does.
        dtype = devices.DTYPES[settings.dtype] if world()[1] == 1 else torch.float32
        self.autocast = lambda: devices.autocast(self.device, dtype)
        self.ref = None
        if settings.loss.kl_coef > 0 and settings.lora is None:  # a LoRA model's reference: its base
            self.ref = copy.deepcopy(model).eval().requires_grad_(False)
        # What the optimizer holds: every parameter, or a LoRA model's adapter (the base is frozen).
        trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in trained]
        groups: list[dict] = [{"params": self.params}]
        if settings.lora is not None and settings.lora.b_lr_ratio != 1:  # LoRA+: B learns faster
            b = [p for n, p in trained if ".lora_B." in n]
            groups = [
                {"params": [p for n, p in trained if ".lora_B." not in n]},
                {"params": b, "lr": settings.lr * settings.lora.b_lr_ratio},
            ]
        self.optimizer = torch.optim.AdamW(
            groups, lr=settings.lr, betas=settings.betas, weight_decay=settings.weight_decay
        )
        warmup = settings.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0
        )
        self.needs_prox = losses.needs_prox(settings.loss)
        self.vocab = model.get_input_embeddings().num_embeddings
        self.skipped: str | None = None
        """Why the last `step` applied nothing (None: it was applied)."""

    def step(self, batch: Batch, version: int | None = None) -> dict[str, float]:
        """Train on `batch` (`minibatches` optimizer steps); returns the step's statistics. `version`: of
        the weights trained, which the staleness statistics count from (default: the version the batch
        was formed for, which a trainer with batches prefetched has often passed already).

        Nothing non-finite is ever applied: a batch with a non-finite advantage or behaviour logprob, or a
        token id outside the embedding, is refused before any forward (the weights stay as they were); a
        minibatch whose loss or gradient norm is not finite is not applied (its gradients are zeroed, the
        optimizer and scheduler do not step) and the rest of the batch is skipped - minibatches before it
        (`minibatches` > 1) stay applied, they were finite. Either way `skipped` says why and the
        returned statistics are `{"skipped": 1.0}`. Every rank decides alike (the data is the same on
        all; the loss verdict is reduced over the ranks)."""
        started = time.perf_counter()
        devices.reset_peak_memory(self.device)
        items = samples(batch, version)
        self.skipped = refusal(items, self.vocab)
        if self.skipped is not None:
            return {"skipped": 1.0}
        stats: dict[str, list[float]] = {}
        tokens = 0
        for index, (part, mbs, prox) in enumerate(self._prepare(items)):
            trained = self._minibatch(index, part, mbs, prox, stats)
            if trained is None:  # not finite, nothing of it applied: `skipped` says why
                return {"skipped": 1.0}
            tokens += trained
        self.model.eval()
        return self._summary(batch, items, stats, tokens, time.perf_counter() - started)

    def _prepare(self, items: list[Sample]) -> list[tuple[list[Sample], list[MicroBatch], list]]:
        """The minibatches of `items`: each one's samples, this rank's micro-batches of it on the device,
        and their proximal logprobs (None where the loss reads none)."""
        rank, size = world()
        parts = split(items, self.settings.minibatches)
        part_mbs = [
            [devices.to_device(mb, self.device) for mb in self._micro_batches(part[rank::size], part[0])]
            for part in parts
        ]
        # The proximal policy is the weights before this batch's update, for every minibatch: computed
        # up front, so a later minibatch does not take the weights an earlier one moved for it.
        part_prox = [
            [self._logprobs(self.model, mb) if self.needs_prox else None for mb in mbs] for mbs in part_mbs
        ]
        return list(zip(parts, part_mbs, part_prox, strict=True))

    def _minibatch(
        self, index: int, part: list[Sample], mbs: list[MicroBatch], prox: list, stats: dict[str, list[float]]
    ) -> int | None:
        """One optimizer step on minibatch `index` (its samples `part`, this rank's micro-batches `mbs`),
        its statistics added to `stats`: the tokens trained, or None when its loss or gradient norm is not
        finite on any rank (nothing applied; `skipped` says why)."""
        # Every rank sees the whole batch: the global denominator; FSDP averages gradients over the
        # ranks, so each rank's share of the mean is scaled by the world size.
        denominator = losses.denominator(self.settings.loss, (s.mask[1:] for s in part)) / world()[1]
        refs = [self._ref_logprobs(mb) for mb in mbs] if self.settings.loss.kl_coef > 0 else [None] * len(mbs)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for mb, p, r in zip(mbs, prox, refs, strict=True):
            loss_sum += self._backward(mb, p, r, float(denominator), stats)
        norm = self._grad_norm()
        stats.setdefault("grad_norm", []).append(norm)
        if sync_max(int(not (math.isfinite(loss_sum) and math.isfinite(norm)))):
            self.optimizer.zero_grad(set_to_none=True)
            self.model.eval()
            self.skipped = f"minibatch {index}: loss {loss_sum} or gradient norm {norm} is not finite"
            return None
        self.optimizer.step()
        self.scheduler.step()
        # Applied: the gradients (4 B/param, a fifth of a step's state) are not held while the
        # trainer publishes and waits for its next batch.
        self.optimizer.zero_grad(set_to_none=True)
        return sum(mb.n_tokens for mb in mbs)

    def _backward(
        self, mb: MicroBatch, prox, ref, denominator: float, stats: dict[str, list[float]]
    ) -> float:
        """Forward and backward of one micro-batch (its gradients add to the others'), its statistics
        added to `stats`; its loss."""
        with self.autocast():
            logp, entropy = token_logprobs(self.model, mb, with_entropy=True)
        loss, s = losses.policy_loss(
            logp, mb.behav, mb.adv, mb.mask, self.settings.loss, prox, ref, denominator
        )
        loss.backward()
        n = mb.mask.sum().clamp(min=1)
        s["loss"] = float(loss.detach())
        s["entropy"] = float((entropy * mb.mask).sum() / n)
        s["engine_mismatch"] = float(((logp.detach() - mb.behav).abs() * mb.mask).sum() / n)
        for k, v in s.items():
            stats.setdefault(k, []).append(v)
        return s["loss"]

    def _grad_norm(self) -> float:
        """The total norm of the gradients, which are clipped to `grad_clip` where it is set."""
        if self.settings.grad_clip is not None:
            return float(torch.nn.utils.clip_grad_norm_(self.params, self.settings.grad_clip))
        grads = [p.grad for p in self.params if p.grad is not None]
        return float(torch.nn.utils.get_total_norm(grads))

    def _summary(
        self, batch: Batch, items: list[Sample], stats: dict[str, list[float]], tokens: int, elapsed: float
    ) -> dict[str, float]:
        """The statistics of a step applied whole: the mean of each micro-batch figure, the loss (the sum
        of its micro-batch parts per minibatch), reward, staleness and its distribution, throughput."""
        lags = [s.version_lag for s in items]
        out = {k: float(np.mean(v)) for k, v in stats.items()}
        out["loss"] = float(np.sum(stats["loss"])) / self.settings.minibatches  # micro-batch parts add up
        rewards = [float(t.reward) for g in batch.groups for t in g.trajectories]
        out.update(
            reward_mean=float(np.mean(rewards)) if rewards else 0.0,
            staleness_mean=float(np.mean(lags)),
            staleness_max=float(np.max(lags)),
            tokens=float(tokens),
            samples=float(len(items)),
            tokens_per_s=tokens / elapsed if elapsed else 0.0,
            step_s=elapsed,
            lr=float(self.scheduler.get_last_lr()[0]),
            peak_memory_gib=devices.peak_memory_gib(self.device),  # the CPU's: the process's so far
        )
        values, counts = np.unique(lags, return_counts=True)
        for lag, count in zip(values, counts, strict=True):  # the distribution: staleness_<lag>
            out[f"staleness_{int(lag)}"] = float(count) / len(lags)
        return out

    def _micro_batches(self, mine: list[Sample], any_sample: Sample) -> list[MicroBatch]:
        """This rank's micro-batches, as many on every rank: FSDP's collectives run in every forward,
        so a rank with fewer runs empty ones (a real sample with its mask zeroed: no gradient)."""
        # Sharing prompts varies the forwards per micro-batch (one or two), and FSDP's collectives must
        # line up across ranks: one process only.
        # Checkpointed layers drop the key/value cache the shared prompts need.
        share = self.settings.share_prefix and world()[1] == 1 and not self.settings.gradient_checkpointing
        mbs = micro_batches(mine, self.settings.micro_batch_tokens, self.pad_id, share) if mine else []
        count = sync_max(len(mbs))
        while len(mbs) < count:
            empty = replace(any_sample, mask=np.zeros_like(any_sample.mask))
            mbs.append(micro_batches([empty], self.settings.micro_batch_tokens, self.pad_id, share)[0])
        return mbs

    def _ref_logprobs(self, mb) -> torch.Tensor:
        """Logprobs of the frozen reference: the starting weights (a LoRA model's base, adapter off)."""
        if self.ref is not None:
            return self._logprobs(self.ref, mb)
        with self.model.disable_adapter():
            return self._logprobs(self.model, mb)

    @torch.no_grad()
    def _logprobs(self, model, mb) -> torch.Tensor:
        model.eval()
        with self.autocast():
            return token_logprobs(model, mb)[0]


def refusal(items: list[Sample], vocab: int) -> str | None:
    """Why a batch of `items` cannot be trained on by a model of `vocab` token embeddings (None: it can)."""
    for i, s in enumerate(items):
        if not math.isfinite(s.advantage):
            return f"sample {i}: advantage {s.advantage} is not finite"
        if not np.isfinite(s.behav).all():
            return f"sample {i}: behaviour logprobs are not finite"
        if len(s.tokens) and (int(s.tokens.min()) < 0 or int(s.tokens.max()) >= vocab):
            low, high = int(s.tokens.min()), int(s.tokens.max())
            return f"sample {i}: token id {low if low < 0 else high} outside the embedding [0, {vocab})"
    return None

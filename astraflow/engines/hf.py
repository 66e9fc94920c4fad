"""The built-in engine on transformers + torch: micro-batched sampling with a KV cache.

Requests that arrive less than `batch_window_ms` apart are generated as one left-padded batch; a
batch runs in a worker thread, one decode step at a time. `pause` parks that thread between two steps,
so weights are swapped between tokens: tokens sampled from logits of the new weights carry the new
version (the KV cache of earlier tokens is kept, as vLLM's `pause?mode=keep` does). The model runs on the
device of `hf_device` (`engine.devices`); sampling is batched on that device (`engines.sampling`): a
seeded request gives the same tokens alone or in a batch.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import Counter
from pathlib import Path

from astraflow.engines.base import Engine, GenerateRequest, GenerateResponse
from astraflow.engines.sampling import Sampler
from astraflow.engines.settings import EngineSettings, hf_device


class HFEngine(Engine):
    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings
        self.version = 0
        self.stats: Counter[str] = Counter()
        """`batches`, `requests`, `steps`, `tokens`, `max_batch`: what batching actually happened."""
        # One lock guards paused/busy/parked; the worker thread parks at a pause point until unpaused.
        self._cond = threading.Condition()
        self._paused = self._busy = self._parked = False
        self._queue: asyncio.Queue | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        await asyncio.to_thread(self._load_model)
        self._queue = asyncio.Queue()
        self._task = asyncio.create_task(self._schedule())

    def _load_model(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if self.settings.threads:
            torch.set_num_threads(self.settings.threads)
        dtype = getattr(torch, self.settings.dtype)
        self.device = torch.device(hf_device(self.settings))
        model = AutoModelForCausalLM.from_pretrained(self.settings.model, dtype=dtype)
        self.model = model.to(self.device).eval()
        tokenizer = AutoTokenizer.from_pretrained(self.settings.model)
        self.eos_ids = {tokenizer.eos_token_id, *_as_set(self.model.generation_config.eos_token_id)} - {None}
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.resume()

    async def healthy(self) -> bool:
        return self._task is not None and not self._task.done()

    async def generate(self, request: GenerateRequest) -> GenerateResponse:
        assert self._queue is not None, "engine not started"
        done = asyncio.get_running_loop().create_future()
        await self._queue.put((request, done, time.perf_counter()))
        return await done

    async def _schedule(self) -> None:
        assert self._queue is not None
        while True:
            batch = [await self._queue.get()]
            # Collect a burst: wait until no request came for one window (at most ten windows in all).
            window = self.settings.batch_window_ms / 1000
            cap = time.perf_counter() + 10 * window
            while len(batch) < self.settings.max_batch:
                wait = min(window, cap - time.perf_counter())
                if wait <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self._queue.get(), wait))
                except TimeoutError:
                    break
            started = time.perf_counter()
            try:
                responses = await asyncio.to_thread(self._generate_batch, [r for r, _, _ in batch])
            except Exception as e:
                for _, done, _ in batch:
                    if not done.done():
                        done.set_exception(e)
                continue
            for (_, done, queued), resp in zip(batch, responses, strict=True):
                resp.timings.update(queue_s=started - queued, generate_s=time.perf_counter() - started)
                if not done.done():
                    done.set_result(resp)

    # -- pause / load / resume ---------------------------------------------------------------------------

    async def pause(self) -> None:
        with self._cond:
            self._paused = True
        await asyncio.to_thread(self._wait_parked)

    def _wait_parked(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: not self._busy or self._parked)

    async def load_weights(self, path: str, version: int) -> None:
        if not self._paused:
            raise RuntimeError("load_weights needs a paused engine")
        await asyncio.to_thread(self._load_state, Path(path))
        self.version = version

    def _load_state(self, path: Path) -> None:
        from safetensors.torch import load_file

        state = {}
        for f in sorted(path.glob("*.safetensors")):
            state.update(load_file(f))
        if not state:
            raise FileNotFoundError(f"no *.safetensors in {path}")
        current = self.model.state_dict()
        tied = {"lm_head.weight"} if self.model.config.tie_word_embeddings else set()
        missing, unexpected = set(current) - set(state) - tied, set(state) - set(current)
        wrong = [k for k in set(state) & set(current) if state[k].shape != current[k].shape]
        if missing or unexpected or wrong:  # checked before anything is copied: no half-loaded model
            raise ValueError(
                f"{path}: weights do not fit (missing {sorted(missing)}, unexpected "
                f"{sorted(unexpected)}, wrong shape {sorted(wrong)})"
            )
        self.model.load_state_dict(state, strict=False)

    async def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def _pause_point(self) -> None:
        with self._cond:
            if not self._paused:
                return
            self._parked = True
            self._cond.notify_all()
            while self._paused:  # a resume followed at once by a new pause keeps it parked
                self._cond.wait()
            self._parked = False

    # -- generation (worker thread) ------------------------------------------------------------------

    def _generate_batch(self, requests: list[GenerateRequest]) -> list[GenerateResponse]:
        with self._cond:
            self._busy = True
        try:
            return self._decode(requests)
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def _decode(self, requests: list[GenerateRequest]) -> list[GenerateResponse]:
        import torch

        n = len(requests)
        self.stats.update(batches=1, requests=n)
        self.stats["max_batch"] = max(self.stats["max_batch"], n)
        params = [r.params for r in requests]
        width = max(len(r.prompt_ids) for r in requests)
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, r in enumerate(requests):
            ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            mask[i, width - len(r.prompt_ids) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        sampler = Sampler.of(params, self.device)
        limits = [
            min(p.max_new_tokens, self.settings.max_model_len - len(r.prompt_ids))
            for p, r in zip(params, requests, strict=True)
        ]
        stops = [self.eos_ids | set(p.stop_token_ids) for p in params]
        out = [GenerateResponse([], [], [], "length") for _ in requests]
        active = [limit > 0 for limit in limits]
        past = None
        with torch.inference_mode():
            for step in itertools.count():
                if not any(active):
                    break
                self._pause_point()
                self.stats["steps"] += 1
                version = self.version
                result = self.model(
                    input_ids=ids,
                    attention_mask=mask,
                    position_ids=positions,
                    past_key_values=past,
                    use_cache=True,
                    logits_to_keep=1,  # the prompt's other positions predict nothing we sample
                )
                past = result.past_key_values
                tokens, logprobs = sampler(result.logits[:, -1, :], step)
                # n tokens and n logprobs to the host: the one copy per step
                for i, (t, lp) in enumerate(zip(tokens.tolist(), logprobs.tolist(), strict=True)):
                    if not active[i]:
                        continue
                    out[i].token_ids.append(t)
                    out[i].logprobs.append(lp)
                    out[i].versions.append(version)
                    if t in stops[i]:
                        out[i].finish_reason, active[i] = "stop", False
                    elif len(out[i].token_ids) >= limits[i]:
                        active[i] = False
                ids = tokens[:, None]
                mask = torch.cat([mask, torch.ones((n, 1), dtype=torch.long, device=self.device)], dim=1)
                positions = positions[:, -1:] + 1
        self.stats["tokens"] += sum(len(o.token_ids) for o in out)
        return out


def _as_set(value) -> set:
    if value is None:
        return set()
    return set(value) if isinstance(value, list | tuple | set) else {value}

"""The built-in engine on transformers + torch: batched sampling with a KV cache.

An idle engine starts a batch at once with every request queued; requests that arrive while a batch
runs make up the next one (`batch_window_ms` can hold an idle engine's batch open for more). A batch runs
in a worker thread, one decode step at a time; the samples of one prompt share its prefill
(`engines.hf_batch`). `pause` parks that thread between two steps, so weights are swapped between
tokens: tokens sampled from logits of the new weights carry the new version (the KV cache of earlier
tokens is kept, as vLLM's `pause?mode=keep` does). The model runs on the device of `hf_device`
(`engine.devices`); sampling is batched on that device (`engines.sampling`): a seeded request gives the
same tokens alone or in a batch.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from astraflow.engines.base import Engine, GenerateRequest, GenerateResponse
from astraflow.engines.hf_batch import Progress, prefill
from astraflow.engines.sampling import Sampler
from astraflow.engines.settings import EngineSettings, hf_device
from astraflow.weights import adapters


class HFEngine(Engine):
    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings
        self.version = 0
        self.stats: Counter[str] = Counter()
        """`batches`, `requests`, `steps`, `tokens`, `max_batch`, `prefilled` (distinct prompts run): what
        batching actually happened."""
        # One lock guards paused/busy/parked; the worker thread parks at a pause point until unpaused.
        self._cond = threading.Condition()
        self._paused = self._busy = self._parked = False
        self._queue: asyncio.Queue | None = None
        self._adapter_config: str | None = None
        """The LoRA adapter config the model serves (None: full weights, no adapter yet)."""
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
        self.tensors_device = str(self.device)
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
        resp = await done
        resp.sampling = request.params
        return resp

    async def _schedule(self) -> None:
        assert self._queue is not None
        while True:
            batch = [await self._queue.get()]
            await asyncio.sleep(0)  # the rest of a burst sent in this turn of the loop (a group's samples)
            # Start at once with what is queued: requests that arrive while this batch runs join the next.
            while len(batch) < self.settings.max_batch and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            await self._wait_window(batch)
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

    async def _wait_window(self, batch: list) -> None:
        """With `batch_window_ms`, let `batch` grow until no request came for one window (at most ten
        windows in all)."""
        assert self._queue is not None
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

    async def load_tensors(self, tensors: Mapping[str, Any], version: int) -> None:
        if not self._paused:
            raise RuntimeError("load_tensors needs a paused engine")
        await asyncio.to_thread(self._apply_state, tensors, "the version's tensors")
        self.version = version

    def _load_state(self, path: Path) -> None:
        from safetensors.torch import load_file

        if adapters.is_adapter_dir(path):
            self._load_adapter(path)
            return
        state = {}
        for f in sorted(path.glob("*.safetensors")):
            state.update(load_file(f))
        if not state:
            raise FileNotFoundError(f"no *.safetensors in {path}")
        self._apply_state(state, path)

    def _apply_state(self, state: Mapping[str, Any], path) -> None:
        """Copy `state` into the model, every name and shape checked first: never half loaded."""
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

    def _load_adapter(self, path: Path) -> None:
        """Make the model serve the LoRA adapter of the PEFT directory `path`: wrapped by `peft` at the
        first one, its adapter's tensors replaced in place at every later one (the base is untouched).
        An adapter of another shape (rank, target modules) is refused before anything is copied."""
        from peft import PeftConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
        from safetensors.torch import load_file

        config = (path / adapters.ADAPTER_CONFIG).read_text()
        if self._adapter_config is None:
            self.model = get_peft_model(self.model, PeftConfig.from_pretrained(str(path))).eval()
            self._adapter_config = config
        state = load_file(path / adapters.ADAPTER_WEIGHTS)
        current = get_peft_model_state_dict(self.model)
        wrong = [k for k in state.keys() & current.keys() if state[k].shape != current[k].shape]
        if config != self._adapter_config or state.keys() != current.keys() or wrong:
            raise ValueError(f"{path}: an adapter unlike the one this engine serves (config or tensors)")
        set_peft_model_state_dict(self.model, state)

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
        sampler = Sampler.of([r.params for r in requests], self.device)
        rows = Progress.of(requests, self.eos_ids, self.settings.max_model_len, self.device)
        tokens = None  # a step's sampled tokens: the next step's input
        with torch.inference_mode():
            for step in itertools.count():
                if not rows.running():
                    break
                self._pause_point()
                self.stats["steps"] += 1
                version = self.version
                if step == 0:
                    prompts = [r.prompt_ids for r in requests]
                    logits, past, mask, positions, distinct = prefill(
                        self.model, prompts, self.pad_id, self.device
                    )
                    self.stats["prefilled"] += distinct
                else:
                    mask = torch.cat([mask, mask.new_ones((n, 1))], dim=1)
                    positions = positions + 1
                    result = self.model(
                        input_ids=tokens[:, None],  # type: ignore[index]
                        attention_mask=mask,
                        position_ids=positions,
                        past_key_values=past,
                        use_cache=True,
                    )
                    logits, past = result.logits[:, -1, :], result.past_key_values
                tokens, logprobs = sampler(logits, step)
                rows.add(tokens, logprobs, version)
        out = rows.responses()
        self.stats["tokens"] += sum(len(o.token_ids) for o in out)
        return out


def _as_set(value) -> set:
    if value is None:
        return set()
    return set(value) if isinstance(value, list | tuple | set) else {value}


ENGINE = HFEngine
"""What `engine.type: hf` runs (`engines.make_engine`)."""

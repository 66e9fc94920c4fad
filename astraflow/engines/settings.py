"""Settings of the inference engine a RaaS worker drives."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from astraflow.errors import ConfigError


class VLLMSettings(BaseModel):
    """How the vLLM server is launched: each field becomes one server flag (see engines/vllm_server.py)."""

    model_config = ConfigDict(extra="forbid")

    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    """Fraction of each GPU's memory the server may take (weights + KV cache); cuda only."""
    tensor_parallel_size: int = Field(1, ge=1)
    """GPUs one server shards the model over."""
    max_num_seqs: int = Field(256, ge=1)
    """Most sequences the server decodes together in one step."""
    enable_prefix_caching: bool = True
    """Reuse the KV cache of shared prompt prefixes (a group's prompts, multi-turn contexts)."""
    extra_args: list[str] = Field(default_factory=list)
    """Further server flags, appended as given, e.g. ["--max-num-batched-tokens", "8192"]."""
    weight_sync: Literal["auto", "pause", "chunks"] = "auto"
    """How a weight load meets running requests. `pause`: requests run whole and are frozen in place
    during a load; the server labels each token with the weight version that sampled it. `chunks`:
    requests run in chunks of `engine.chunk_tokens`, a load lands between chunks. `auto` = pause where
    the server has the endpoints for it, else chunks (logged as a warning, with the reason). `pause` where
    the installed vLLM cannot honour it is refused at start (ConfigError)."""
    stream_interval: int = Field(64, ge=1)
    """pause: tokens per event of a streamed generate call (`--stream-interval`); the first and the last
    come at once. Per-token versions do not depend on it: the server labels the tokens itself."""
    weight_transfer: Literal["auto", "buffer", "files", "nccl", "ipc"] = "auto"
    """How a load puts new weights into the server. `buffer`: astraflow's weight-transfer engine in the
    server's workers maps the RaaS's verified buffer (shared memory) and copies it into the model's
    parameters; vLLM opens no checkpoint (engines/vllm_buffer.py). `files`: its workers reload the pulled,
    verified checkpoint directory (`/collective_rpc reload_weights`). `auto` = buffer where the installed
    vLLM has weight-transfer engines, else files. `nccl`, `ipc`: vLLM's native weight transfer from a
    trainer on the same node; not built yet (refused at start)."""
    cpu_queue_nap_us: int = Field(200, ge=0, le=100_000)
    """cpu: how long a vLLM process waiting on the shared-memory queue between its engine core and its
    worker sleeps between looks (microseconds). vLLM's own wait (0) spins for a second after each
    message, yielding the core, which on a machine of few cores is CPU the trainer and the RaaS lack."""
    max_lora_rank: int = Field(0, ge=0)
    """LoRA: the policy's versions are adapters of up to this rank, each loaded at runtime as its own
    adapter (`--enable-lora`, engines/vllm_lora.py); 0 = full weights. A run whose trainer trains LoRA
    (`trainer.lora`) sets it to the adapter's rank."""


ENGINE_TYPES = ("vllm", "hf", "openai")
"""The registered engines, by name: each is the module `astraflow/engines/<name>.py` whose `ENGINE` is its
class (`engines.make_engine`)."""


class EngineSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal[("auto", *ENGINE_TYPES)] = "auto"  # type: ignore[valid-type]
    """`auto` = vllm when installed, else hf."""
    model: str = ""
    """Model directory (Hugging Face layout) the engine serves; for `openai`, the served model name."""
    tokenizer: str | None = None
    """Directory of the tokenizer whose ids the engine takes and returns (workflows speak token ids);
    default `model`. An `openai` endpoint's model is a name, not a directory: give its tokenizer here."""
    dtype: str = "float32"
    """Weights dtype in the engine (`bfloat16` is what vLLM on CPU runs best); vllm: `--dtype`."""
    max_model_len: int = Field(512, gt=0)
    """Longest prompt + completion, in tokens; vllm: `--max-model-len`."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the engine runs (hf: the model; vllm: the server); `auto` = cuda when torch sees a GPU.
    CPU-only vLLM server settings (KV cache size, eager mode) apply on cpu only."""
    vllm: VLLMSettings = Field(default_factory=VLLMSettings)
    """vllm: server flags."""
    threads: int = Field(0, ge=0)
    """torch threads of the hf engine; 0 = torch's default."""
    max_batch: int = Field(64, ge=1)
    """hf: most requests generated together in one batch."""
    batch_window_ms: int = Field(0, ge=0)
    """hf: an idle engine starts a batch at once with the requests queued (0); more holds the batch open
    until no request arrived for this long (at most ten windows). Requests that arrive while a batch runs
    always join the next one."""
    kv_cache_gb: float = Field(1.0, gt=0)
    """vllm on CPU: KV cache size, GiB (VLLM_CPU_KVCACHE_SPACE); on cuda see vllm.gpu_memory_utilization."""
    devices: str = ""
    """The GPUs of the engine (CUDA_VISIBLE_DEVICES ids, e.g. "0" or "2,3"); "" = inherited. vllm: its
    server's CUDA_VISIBLE_DEVICES. hf: one id, the GPU the model and its sampling run on (see
    `hf_device`). Ignored where the engine runs on the CPU."""
    port: int = Field(0, ge=0)
    """vllm: server port; 0 = a free one."""
    chunk_tokens: int = Field(16, ge=1)
    """vllm with chunked weight sync: tokens per completion call; a load waits for running chunks."""
    start_timeout_s: float = Field(300.0, gt=0)
    """vllm: how long the server may take to become healthy."""
    base_url: str = ""
    """openai: endpoint, e.g. http://127.0.0.1:8000/v1."""
    api_key: SecretStr | None = None
    """openai: bearer token; never printed."""


PROCESSING_FLAGS = (
    "--logits-processors",
    "--logprobs-mode",
    "--generation-config",
    "--override-generation-config",
)
"""vLLM server flags that change how logits become the sampled distribution or its reported logprobs
beyond temperature, top-k and top-p (a logits processor, the model's default penalties, raw logprobs):
the trainer cannot score tokens the same way."""


def unreproducible(settings: EngineSettings) -> str | None:
    """Why a trainer cannot score this engine's samples as they were sampled (None: it can): every loss
    takes a ratio or weight against the engine's logprobs, which must be of the distribution the trainer
    recomputes (temperature, top-k, top-p: `astraflow.logits`)."""
    if settings.type == "openai":
        return "the openai engine's logprobs are whatever its endpoint reports, and it loads no weights"
    flags = [a.partition("=")[0] for a in settings.vllm.extra_args]
    bad = [f for f in PROCESSING_FLAGS if f in flags or f.replace("-", "_") in flags]
    if bad:
        flags = ", ".join(bad)
        return f"vllm.extra_args {flags} changes the sampled distribution beyond temperature/top-k/top-p"
    return None


def resolve_device(settings: EngineSettings) -> str:
    """`cpu` or `cuda`; `auto` asks torch whether it sees a GPU (torch is imported only then)."""
    if settings.device != "auto":
        return settings.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def hf_device(settings: EngineSettings) -> str:
    """The one device an in-process (hf) engine runs on: `cpu` where `resolve_device` says cpu (with
    `auto`: torch sees no GPU), else `cuda:N`, N the torch index of the GPU `engine.devices` names (the
    first one torch sees when it names none). Raises ConfigError for a GPU this process cannot use."""
    if resolve_device(settings) == "cpu":
        return "cpu"
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ConfigError(
            f"engine.device is {settings.device!r} but torch sees no CUDA device (a CPU build, or none"
            " visible); set engine.device to cpu or auto"
        )
    index = (
        gpu_index(settings.devices, os.environ.get("CUDA_VISIBLE_DEVICES"), count) if settings.devices else 0
    )
    return f"cuda:{index}"


def gpu_index(devices: str, visible: str | None, count: int) -> int:
    """The torch index of the single GPU id in `devices`, in a process whose CUDA_VISIBLE_DEVICES is
    `visible` (None: unset, ids are torch indices) and where torch sees `count` GPUs."""
    ids = [d.strip() for d in devices.split(",") if d.strip()]
    if len(ids) != 1:
        raise ConfigError(
            f"engine.devices is {devices!r}: the hf engine runs on one GPU, name one id (the vllm engine"
            " with engine.vllm.tensor_parallel_size runs on several)"
        )
    seen = [v.strip() for v in visible.split(",")] if visible is not None else [str(i) for i in range(count)]
    if ids[0] not in seen[:count]:
        raise ConfigError(
            f"engine.devices is {devices!r} but this process sees GPU(s) {seen[:count]}"
            + (f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else "")
        )
    return seen.index(ids[0])

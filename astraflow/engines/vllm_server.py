"""The vLLM server's command line and environment from the engine settings, what a running server
supports, and the wire format of its generation calls. Nothing here imports vllm or starts a process."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
import uuid
from pathlib import Path

from astraflow.engines import vllm_lora, vllm_plugin
from astraflow.engines.base import GenerateRequest, GenerateResponse
from astraflow.engines.settings import EngineSettings
from astraflow.errors import ConfigError

SERVED_NAME = "policy"
GENERATE_PATH = "/inference/v1/generate"
"""Token-in/token-out generation whose final output labels token spans with weight versions."""
SOCKET_PATH_MAX = 107
"""The longest path of a Unix socket (Linux's `sun_path`, less its terminating byte)."""
PAUSE_SYNC_PATHS = (GENERATE_PATH, "/pause", "/resume", "/collective_rpc", "/update_weight_version")


def vllm_has(*parts: str) -> bool:
    """Whether the installed vLLM package holds the path `parts`; looked up on disk, so that vllm is not
    imported into this process."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return False
    return Path(next(iter(spec.submodule_search_locations)), *parts).exists()


def has_scale_out() -> bool:
    """Whether the installed vLLM ships the token-in/token-out server (`--enable-scale-out`)."""
    return vllm_has("entrypoints", "scale_out", "token_in_token_out")


def weight_transfer(settings: EngineSettings) -> str:
    """The weight transfer of `engine.vllm.weight_transfer` in effect: `auto` is `buffer` where the
    installed vLLM has pluggable weight-transfer engines, else `files`. ConfigError for `buffer` where it
    has none."""
    t = settings.vllm.weight_transfer
    pluggable = vllm_has("distributed", "weight_transfer", "factory.py")
    if t == "auto":
        return "buffer" if pluggable else "files"
    if t == "buffer" and not pluggable:
        raise ConfigError(
            "engine.vllm.weight_transfer=buffer: the installed vllm has no weight-transfer engines "
            "(vllm.distributed.weight_transfer); install the pinned one or set weight_transfer to files"
        )
    return t


def planned_sync(settings: EngineSettings) -> tuple[str, str]:
    """The weight-sync mode the server is started for (`pause` or `chunks`) and, where `auto` falls back to
    chunks, why ("" otherwise). Raises ConfigError for `pause` when the installed vLLM cannot honour it."""
    sync = settings.vllm.weight_sync
    if sync == "chunks":
        return "chunks", ""
    if has_scale_out():
        return "pause", ""
    reason = "the installed vllm has no token-in/token-out server (vllm.entrypoints.scale_out)"
    if sync == "pause":
        raise ConfigError(
            f"engine.vllm.weight_sync=pause: {reason}; install the pinned one (make setup EXTRAS=gpu, or "
            "cpu) or set weight_sync to auto or chunks"
        )
    return "chunks", reason


def served_sync(settings: EngineSettings, openapi: dict) -> tuple[str, str]:
    """The weight-sync mode a running server allows, from its OpenAPI schema, and why `auto` fell back to
    chunks ("" when it did not). Raises ConfigError for `pause` when the server cannot honour it."""
    mode, reason = planned_sync(settings)
    missing = missing_for_pause(openapi) if mode == "pause" else []
    if not missing:
        return mode, reason
    reason = f"the vllm server lacks {', '.join(missing)}"
    if settings.vllm.weight_sync == "pause":
        raise ConfigError(f"engine.vllm.weight_sync=pause: {reason}")
    return "chunks", reason


def server_command(settings: EngineSettings, port: int, device: str) -> tuple[list[str], dict[str, str]]:
    """The server's argv and environment for `device` (`cpu` or `cuda`)."""
    s, v = settings, settings.vllm
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        s.model,
        "--served-model-name",
        SERVED_NAME,
        # Loopback only: with VLLM_SERVER_DEV_MODE the server also exposes control endpoints (/pause,
        # /collective_rpc, /reset_prefix_cache, ...) that load arbitrary weights, on this same socket.
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        s.dtype,
        "--max-model-len",
        str(s.max_model_len),
        "--tensor-parallel-size",
        str(v.tensor_parallel_size),
        "--max-num-seqs",
        str(v.max_num_seqs),
        "--enable-prefix-caching" if v.enable_prefix_caching else "--no-enable-prefix-caching",
        # Logprobs of the distribution sampled from (after temperature, top-k, top-p), which the trainer
        # recomputes; and vLLM's neutral sampling defaults, not the model's generation_config.json (its
        # repetition_penalty or min_p would change the distribution in ways the trainer cannot score).
        "--logprobs-mode",
        "processed_logprobs",
        "--generation-config",
        "vllm",
    ]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    # vLLM's processes talk over Unix sockets named <its temporary directory>/<uuid4>; a longer name than
    # a socket's (107 bytes) fails its start, so a long TMPDIR gets them a short directory.
    if (
        "VLLM_RPC_BASE_PATH" not in env
        and len(f"{tempfile.gettempdir()}/{uuid.UUID(int=0)}") > SOCKET_PATH_MAX
    ):
        env["VLLM_RPC_BASE_PATH"] = "/tmp"
    if device == "cuda":
        cmd += ["--gpu-memory-utilization", str(v.gpu_memory_utilization)]
    else:
        # CUDA graphs do not exist on CPU, and the CPU backend sizes its KV cache from this variable.
        cmd.append("--enforce-eager")
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(s.kv_cache_gb)))
        env[vllm_plugin.QUEUE_NAP_ENV] = str(v.cpu_queue_nap_us)
    if planned_sync(settings)[0] == "pause":
        cmd += ["--enable-scale-out", "--stream-interval", str(v.stream_interval)]
    if weight_transfer(settings) == "buffer":
        cmd += ["--weight-transfer-config", json.dumps({"backend": vllm_plugin.BACKEND})]
        if not vllm_plugin.installed():  # the workers register the engine as they import their extension
            cmd += ["--worker-extension-cls", vllm_plugin.WORKER_EXTENSION]
    if v.max_lora_rank:
        cmd += vllm_lora.server_flags(v.max_lora_rank)
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    return cmd + list(v.extra_args), env


def missing_for_pause(openapi: dict) -> list[str]:
    """What a server's OpenAPI schema lacks of pause-mode weight sync: its endpoints, and generate replies
    that carry weight-version spans; [] when nothing."""
    paths = openapi.get("paths", {})
    schemas = openapi.get("components", {}).get("schemas", {})
    missing = [p for p in PAUSE_SYNC_PATHS if p not in paths]
    return missing + ([] if "WeightVersionSpan" in schemas else ["weight-version spans"])


def completion_body(
    request: GenerateRequest, context: list[int], max_tokens: int, done: int, n: int = 1
) -> dict:
    """A `/v1/completions` call for `n` completions continuing `context` (the prompt and the `done` tokens
    generated so far)."""
    p = request.params
    body = {
        "model": SERVED_NAME,
        "prompt": context,
        "n": n,
        "max_tokens": max_tokens,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": p.top_k if p.top_k > 0 else -1,
        "logprobs": 0,
        "return_token_ids": True,
        "stop_token_ids": list(p.stop_token_ids),
        "skip_special_tokens": False,
    }
    if p.seed is not None:
        body["seed"] = p.seed + done
    return body


def generate_body(request: GenerateRequest, max_tokens: int, version: int, n: int = 1) -> dict:
    """A streamed token-in/token-out call for `n` whole completions of the request, submitted while
    `version` is served."""
    p = request.params
    sampling = {
        "n": n,
        "max_tokens": max_tokens,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": p.top_k,
        "logprobs": 0,
        "stop_token_ids": list(p.stop_token_ids),
        "skip_special_tokens": False,
        "seed": p.seed,
    }
    return {
        "model": SERVED_NAME,
        "token_ids": request.prompt_ids,
        "sampling_params": sampling,
        "stream": True,
        "cache_salt": f"v{version}",  # no prefix-cache hits on KV blocks computed with other weights
    }


class GenerateStream:
    """Collects a streamed generate reply (server-sent events) of `n` completions, one line at a time."""

    def __init__(self, n: int = 1) -> None:
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.logprobs: list[list[float]] = [[] for _ in range(n)]
        self.finish: list[str | None] = [None] * n
        self.spans: list[list[dict]] = [[] for _ in range(n)]
        self.events = 0
        """Events that brought tokens or the end (the server sends one per `stream_interval` tokens of each
        completion)."""

    def feed(self, line: str) -> int:
        """Take one line of the reply; returns how many tokens it brought."""
        if not line.startswith("data: ") or line == "data: [DONE]":
            return 0
        self.events += 1
        n = 0
        for choice in json.loads(line[len("data: ") :])["choices"]:
            i = choice.get("index", 0)
            new = choice["token_ids"] or []
            self.tokens[i] += new
            self.logprobs[i] += [c["logprob"] for c in (choice["logprobs"] or {}).get("content") or []]
            n += len(new)
            if choice["finish_reason"] is not None:
                self.finish[i], self.spans[i] = choice["finish_reason"], choice["weight_versions"] or []
        return n

    def responses(self) -> list[GenerateResponse]:
        """The completions, each token with the version that sampled it; raises unless all ended normally."""
        out = []
        for i, tokens in enumerate(self.tokens):
            if self.finish[i] not in ("stop", "length"):
                raise RuntimeError(f"vllm request ended with {self.finish[i]!r}")
            versions = token_versions(self.spans[i], len(tokens))
            out.append(GenerateResponse(tokens, self.logprobs[i], versions, self.finish[i]))
        return out


def token_versions(spans: list[dict], n_tokens: int) -> list[int]:
    """Per-token versions from the server's `[start, end)` spans of version labels (our versions as text).

    Raises ValueError unless the spans cover exactly `n_tokens` tokens with integer labels."""
    versions: list[int] = []
    for span in spans:
        if span["start"] != len(versions):
            raise ValueError(f"weight version spans leave a gap: {spans}")
        versions += [int(span["version"])] * (span["end"] - span["start"])
    if len(versions) != n_tokens:
        raise ValueError(f"weight version spans cover {len(versions)} of {n_tokens} tokens: {spans}")
    return versions

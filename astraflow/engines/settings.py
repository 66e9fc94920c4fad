"""Settings of the inference engine a RaaS worker drives."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr


class EngineSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["auto", "vllm", "hf", "openai"] = "auto"
    """`auto` = vllm when installed, else hf."""
    model: str = ""
    """Model directory (Hugging Face layout) the engine serves; for `openai`, the served model name."""
    dtype: str = "float32"
    """Weights dtype in the engine (`bfloat16` is what vLLM on CPU runs best)."""
    max_model_len: int = Field(512, gt=0)
    """Longest prompt + completion, in tokens."""
    threads: int = Field(0, ge=0)
    """torch threads of the hf engine; 0 = torch's default."""
    max_batch: int = Field(64, ge=1)
    """hf: most requests generated together in one batch."""
    batch_window_ms: int = Field(5, ge=0)
    """hf: a batch closes when no request arrived for this long (at most ten windows after its first)."""
    kv_cache_gb: float = Field(1.0, gt=0)
    """vllm on CPU: KV cache size (VLLM_CPU_KVCACHE_SPACE)."""
    devices: str = ""
    """vllm: the GPUs its server uses (CUDA_VISIBLE_DEVICES, e.g. "0" or "2,3"); "" = inherited."""
    port: int = Field(0, ge=0)
    """vllm: server port; 0 = a free one."""
    chunk_tokens: int = Field(16, ge=1)
    """vllm: tokens generated per request before the version is checked again (see engines/vllm.py)."""
    start_timeout_s: float = Field(300.0, gt=0)
    """vllm: how long the server may take to become healthy."""
    base_url: str = ""
    """openai: endpoint, e.g. http://127.0.0.1:8000/v1."""
    api_key: SecretStr | None = None
    """openai: bearer token; never printed."""

"""Inference engines behind one protocol (`Engine`): vllm, hf, openai; `make_engine` picks one."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from astraflow.engines.base import Engine, GenerateRequest, GenerateResponse, SamplingParams, WeightLoader
from astraflow.engines.settings import EngineSettings

__all__ = [
    "Engine",
    "EngineSettings",
    "GenerateRequest",
    "GenerateResponse",
    "SamplingParams",
    "WeightLoader",
    "make_engine",
]


def resolve_type(settings: EngineSettings) -> str:
    """`auto` means vllm where it is installed, else the built-in hf engine."""
    if settings.type != "auto":
        return settings.type
    return "vllm" if importlib.util.find_spec("vllm") is not None else "hf"


def make_engine(settings: EngineSettings, log_path: str | Path | None = None) -> Engine:
    t = resolve_type(settings)
    if t == "hf":
        from astraflow.engines.hf import HFEngine

        return HFEngine(settings)
    if t == "vllm":
        from astraflow.engines.vllm import VLLMEngine

        return VLLMEngine(settings, log_path)
    if t == "openai":
        from astraflow.engines.openai import OpenAIEngine

        return OpenAIEngine(settings)
    raise ValueError(f"unknown engine type: {t!r}")

"""Inference engines behind one protocol (`Engine`); `make_engine` picks one.

An engine registers by name: its name is a value of `engine.type` (`settings.ENGINE_TYPES`), and its
module `astraflow/engines/<name>.py` says which class it is (`ENGINE = ...`). So adding an engine is
its module and its name; `tests/unit/test_registries.py` fails when one half is missing.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

from astraflow.engines.base import Engine, GenerateRequest, GenerateResponse, SamplingParams, WeightLoader
from astraflow.engines.settings import ENGINE_TYPES, EngineSettings

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


def engine_class(name: str) -> type[Engine]:
    """The class of the engine registered as `name` (its module imported now: engines are heavy)."""
    if name not in ENGINE_TYPES:
        raise ValueError(f"unknown engine type: {name!r}")
    return importlib.import_module(f"{__name__}.{name}").ENGINE


def make_engine(settings: EngineSettings, log_path: str | Path | None = None) -> Engine:
    """The engine of `settings.type` (`auto` resolved), not started."""
    return engine_class(resolve_type(settings)).create(settings, log_path)

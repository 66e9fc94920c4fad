"""One node's GPUs laid out by `astraflow run`: the trainer's ranks and the RaaS engines.

The recipe's `layout:` section says how many GPUs the node has (`auto`: those visible), how many the
trainer takes (FSDP2 under torchrun, one rank per GPU) and how many each RaaS engine takes (1: one engine
per GPU; more: tensor parallel across them). The rest of the GPUs, after the trainer's, are split into
engines, one RaaS worker each. On a node of one GPU the trainer and one engine share it.

`plan` is pure (ids in, ids out); the settings rule `check_layout` applies it to the sections, so every
process sees the same effective settings, and the launcher (`launch.launcher.workers`) gives each process
its GPUs (`CUDA_VISIBLE_DEVICES`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from astraflow.errors import RuleError

NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")
"""One entry per GPU the NVIDIA driver drives (counted for `gpus: auto` without CUDA_VISIBLE_DEVICES)."""


class LayoutSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    gpus: Annotated[int, Field(ge=0)] | Literal["auto"] = 0
    """GPUs of this node `astraflow run` lays out: a count (ids 0 to n-1), `auto` = the visible ones
    (CUDA_VISIBLE_DEVICES, else every GPU the driver has), 0 = no layout (each section as it says)."""
    gpu_ids: list[Annotated[str, BeforeValidator(str)]] = Field(default_factory=list)
    """The ids of those GPUs (CUDA_VISIBLE_DEVICES values); [] = 0 to gpus-1. `auto` fills both."""
    trainer_gpus: Annotated[int, Field(ge=1)] | Literal["auto"] = "auto"
    """GPUs of the trainer, one FSDP2 rank each (torchrun when more than one); `auto` = half of them,
    the rest a whole number of engines (on one GPU, the trainer and the one engine share it)."""
    engine_gpus: int = Field(1, ge=1)
    """GPUs per RaaS engine: 1 = one engine per GPU; more = tensor parallel across them (vllm)."""


@dataclass(frozen=True)
class Plan:
    """Who computes on which GPU ids."""

    trainer: tuple[str, ...]
    """The trainer's GPUs, rank i on the i-th."""
    engines: tuple[tuple[str, ...], ...]
    """Each RaaS worker's engine GPUs (raas-i the i-th)."""

    def lines(self) -> list[str]:
        """The layout in words, a line per trainer rank and per engine (for the launcher's view)."""
        how = " (FSDP2, torchrun)" if len(self.trainer) > 1 else ""
        out = [f"trainer rank {r}: GPU {gpu}{how}" for r, gpu in enumerate(self.trainer)]
        for i, ids in enumerate(self.engines):
            tp = f" (tensor parallel {len(ids)})" if len(ids) > 1 else ""
            out.append(f"raas-{i} engine: GPU {','.join(ids)}{tp}")
        return out


def visible_ids(environ=os.environ) -> list[str]:
    """The GPU ids this process may use: CUDA_VISIBLE_DEVICES when set, else one per GPU the driver has."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [v.strip() for v in visible.split(",") if v.strip()]
    count = len(list(NVIDIA_GPUS.iterdir())) if NVIDIA_GPUS.is_dir() else 0
    return [str(i) for i in range(count)]


def resolve(layout: LayoutSettings, environ=os.environ) -> LayoutSettings:
    """`layout` with `gpus` a count and `gpu_ids` its ids (`auto` resolved from this process's view)."""
    if layout.gpus == "auto":
        ids = visible_ids(environ)
        if not ids:
            raise RuleError("layout.gpus", "is auto but no GPU is visible (CUDA_VISIBLE_DEVICES, driver)")
        return layout.model_copy(update={"gpus": len(ids), "gpu_ids": ids})
    if layout.gpu_ids and len(layout.gpu_ids) != layout.gpus:
        raise RuleError("layout.gpu_ids", f"names {len(layout.gpu_ids)} GPUs, layout.gpus {layout.gpus}")
    return layout.model_copy(update={"gpu_ids": layout.gpu_ids or [str(i) for i in range(layout.gpus)]})


def plan(layout: LayoutSettings) -> Plan:
    """The processes' GPUs for a resolved `layout` (`resolve`); raises RuleError (one line, naming the
    setting) when it does not fit."""
    ids, n, per = tuple(layout.gpu_ids), int(layout.gpus), layout.engine_gpus
    if n == 1:
        if layout.trainer_gpus not in ("auto", 1) or per != 1:
            raise RuleError(
                "layout", "one GPU: the trainer and one engine share it (trainer_gpus 1, engine_gpus 1)"
            )
        return Plan(ids, (ids,))
    trainer = layout.trainer_gpus
    if trainer == "auto":
        trainer = n - max(per, (n // 2) // per * per)
    rest = n - trainer
    if rest < per:
        raise RuleError(
            "layout.trainer_gpus",
            f"{trainer} for the trainer leaves {max(rest, 0)} of {n} GPUs: no room for an engine of {per}",
        )
    if rest % per:
        raise RuleError(
            "layout.engine_gpus",
            f"the {rest} GPUs left after the trainer's {trainer} do not split into engines of {per}",
        )
    engines = tuple(ids[trainer + i : trainer + i + per] for i in range(0, rest, per))
    return Plan(ids[:trainer], engines)

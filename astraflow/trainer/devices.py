"""Where a trainer computes and in what precision; copies of its state into host memory.

Parameters, gradients' reduction and optimizer state are always float32 (the master weights). With
`trainer.dtype: bfloat16` the forwards and backwards compute in bf16: in one process through
`torch.autocast` on the device, under torchrun through FSDP2's `MixedPrecisionPolicy` (bf16 copies of
the gathered parameters, gradients reduced in float32).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import torch

from astraflow.errors import ConfigError
from astraflow.trainer.settings import TrainerSettings

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve(settings: TrainerSettings) -> torch.device:
    """This process's device: `cuda:LOCAL_RANK` (0 without torchrun) or the CPU. `auto` takes CUDA when
    every local rank gets a GPU of its own. Raises ConfigError for a device or precision this machine
    lacks."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    kind = settings.device
    if kind == "auto":
        kind = "cuda" if gpus >= local_ranks else "cpu"
    if kind == "cpu":
        return torch.device("cpu")
    if gpus <= local:
        raise ConfigError(
            f"trainer.device is {settings.device!r} but this process (local rank {local}) has no GPU:"
            f" torch sees {gpus} CUDA device(s){'' if gpus else ' (a CPU build, or none visible)'};"
            " set trainer.device to cpu, or start at most one rank per GPU"
        )
    device = torch.device("cuda", local)
    if settings.dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"trainer.dtype is bfloat16 but {torch.cuda.get_device_name(device)} lacks it")
    return device


def autocast(device: torch.device, dtype: torch.dtype):
    """The forward's precision context in one process: bf16 autocast, or nothing for float32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def reset_peak_memory(device: torch.device) -> None:
    """Start `peak_memory_gib`'s count afresh (CUDA; the CPU's high-water mark cannot be reset)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device: torch.device) -> float:
    """CUDA: the most memory torch allocated on `device` since `reset_peak_memory` (a step's peak, what
    the 16 B/param + 8 GiB budget counts). CPU: the process's peak resident memory so far (getrusage's
    high-water mark: a step shows its own peak only when it is the highest yet)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30  # Linux: KiB


def to_device(mb, device: torch.device):
    """A micro-batch (a dataclass of tensors) on `device`; itself when already there."""
    if device.type == "cpu":
        return mb
    moved = {f.name: getattr(mb, f.name).to(device, non_blocking=True) for f in dataclasses.fields(mb)}
    return dataclasses.replace(mb, **moved)


def to_host(obj):
    """A copy of `obj` (tensors in dicts, lists and tuples) in host memory that later steps do not change.
    Tensors that are the same memory (tied weights) stay one tensor in the copy. From a GPU, each tensor
    goes asynchronously into fresh pinned memory and all are awaited once."""
    copied_from_gpu = False
    copies: dict[tuple, torch.Tensor] = {}

    def copy_tensor(x: torch.Tensor) -> torch.Tensor:
        nonlocal copied_from_gpu
        x = x.detach()
        if not x.is_cuda:
            return x.clone()
        copied_from_gpu = True
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        return host.copy_(x, non_blocking=True)

    def copy(x):
        if isinstance(x, torch.Tensor):
            if x.numel() == 0:  # storages of nothing share address 0
                return copy_tensor(x)
            key = (x.device, x.untyped_storage().data_ptr(), x.storage_offset(), x.shape, x.stride(), x.dtype)
            if key not in copies:
                copies[key] = copy_tensor(x)
            return copies[key]
        if isinstance(x, dict):
            return {k: copy(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return type(x)(copy(v) for v in x)
        return x  # numbers, strings, None: immutable

    out = copy(obj)
    if copied_from_gpu:
        torch.cuda.synchronize()  # the copies are queued on the device's stream: done before any read
    return out

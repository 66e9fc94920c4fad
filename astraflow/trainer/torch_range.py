"""The torch releases the trainer supports.

A GPU node brings its own CUDA build of torch (clusters lag the newest release by several versions), so the
trainer uses only what exists from `OLDEST` to `NEWEST` (`torch.distributed.all_gather_into_tensor`, not
2.13's `all_gather_single`; FSDP2's `fully_shard` from `torch.distributed.fsdp`, public since 2.6). CI runs
the FSDP2 tests at both ends: the pinned CPU stack (`NEWEST`) and a separate environment at `OLDEST`
(`make test-oldest-torch`). Why 2.7: the transformers the trainer needs (5.16 to 5.19) calls
`torch.accelerator.current_accelerator()`, which torch 2.6 answers with an error on a machine without a GPU,
so 2.6 cannot be tested on a CPU runner; 2.5 lacks `torch.accelerator` altogether.
"""

from __future__ import annotations

import re

OLDEST = (2, 7)
"""The oldest torch release supported and tested (`pyproject.toml`'s minimum)."""
NEWEST = (2, 13)
"""The newest torch release tested (what the CPU inference stack pins); newer ones are untested."""


LORA_SHARDED_OLDEST = (2, 13)
"""The oldest torch on which a LoRA adapter trained under FSDP2 was shown to equal one process's
(tests/integration/test_fsdp.py). On 2.7.1 the adapter's B matrices came out up to a fifth of the learning
rate apart after two steps, nearly every element: a sharded LoRA trainer is refused there
(`lora_sharding_refusal`), as on every release in between until one is tested."""


def parse(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string such as `2.11.0+cu130` or `2.14.0.dev20260101`."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"not a torch version: {version!r}")
    return int(match[1]), int(match[2])


def described() -> str:
    """The supported range in words, for messages and docs."""
    return f"torch {OLDEST[0]}.{OLDEST[1]} to {NEWEST[0]}.{NEWEST[1]}.x"


def refusal(version: str) -> str | None:
    """Why torch `version` is not supported (None: it is), in one line."""
    if OLDEST <= parse(version) <= NEWEST:
        return None
    return f"torch {version} is outside the supported range: {described()}"


def lora_sharding_refusal(version: str) -> str | None:
    """Why a LoRA adapter may not be trained under FSDP2 on torch `version` (None: it may), in one line."""
    if parse(version) >= LORA_SHARDED_OLDEST:
        return None
    oldest = ".".join(map(str, LORA_SHARDED_OLDEST))
    return (
        f"LoRA under FSDP2 needs torch {oldest} or newer (on {version} its adapter's gradients are not one "
        "process's): train it on one device, or use a newer torch"
    )

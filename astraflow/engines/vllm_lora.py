"""LoRA versions on a vLLM server: each version a runtime-loaded adapter, requests on the newest.

With `engine.vllm.max_lora_rank` the server starts with `--enable-lora` and runtime adapter loading
(`VLLM_ALLOW_RUNTIME_LORA_UPDATING`). A load is `/v1/load_lora_adapter` of the version's verified half, a
PEFT adapter directory, copied first into a directory of its own (vLLM reads an adapter again from its
path when its cache evicted it, and the half is rewritten two versions later), under the name
`v<version>`. Nothing is paused: a request runs whole on the adapter that was newest when it started
(each of its tokens tagged with that version), new requests go to the newest, and an older adapter is
unloaded (its copy removed) once no request generates with it.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

import structlog

from astraflow.errors import describe
from astraflow.weights import adapters

log = structlog.get_logger(__name__)

Control = Callable[[str, dict | None], Awaitable[None]]
"""POSTs a JSON body to a path of the server; raises on an error reply."""
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ranks vLLM's `--max-lora-rank` takes; an adapter of any rank up to it loads."""
MAX_LORAS = 4
"""Adapters one batch may mix: the newest and those before it whose requests are still running."""


def server_flags(rank: int) -> list[str]:
    """The server flags that serve adapters of rank up to `rank`."""
    ceiling = next((r for r in MAX_LORA_RANKS if r >= rank), None)
    if ceiling is None:
        raise ValueError(f"LoRA rank {rank} is above vLLM's largest, {MAX_LORA_RANKS[-1]}")
    # The CPU cache holds the adapters in use and a spare, so none in use is evicted (and read again).
    loras = ["--max-loras", str(MAX_LORAS), "--max-cpu-loras", str(2 * MAX_LORAS)]
    return ["--enable-lora", "--max-lora-rank", str(ceiling), *loras]


def name(version: int) -> str:
    """The adapter name of `version` on the server (what a request's `model` names)."""
    return f"v{version}"


class Adapters:
    """The adapters one server holds, and which requests use which."""

    def __init__(self, control: Control) -> None:
        self.control = control
        self.current: int | None = None
        """The newest version loaded (None: none yet: requests run on the base, which is version 0)."""
        self.spool = Path(tempfile.mkdtemp(prefix="astraflow-lora-"))
        """The adapters' own copies, one directory per version loaded (0700)."""
        self._users: Counter[int] = Counter()
        self._loaded: set[int] = set()

    async def load(self, path: str, version: int) -> None:
        """Load the adapter directory `path` as `version`, the one new requests use; unload the older
        ones no request uses. ValueError for a directory that holds no adapter."""
        if not adapters.is_adapter_dir(path):
            raise ValueError(f"{path}: not a LoRA adapter, and this server serves adapters (max_lora_rank)")
        copy = self.spool / name(version)
        await asyncio.to_thread(_copy_adapter, Path(path), copy)
        await self._register(version)
        self.current = version
        await self._drop_unused()

    async def _register(self, version: int) -> None:
        body = {"lora_name": name(version), "lora_path": str(self.spool / name(version))}
        await self.control("/v1/load_lora_adapter", body)
        self._loaded.add(version)

    async def restarted(self) -> None:
        """After the server restarted (it holds no adapter): load the newest again."""
        self._loaded.clear()
        if self.current is not None:
            await self._register(self.current)

    def acquire(self) -> int | None:
        """The version a request starting now runs on, counted as used until `release`."""
        if self.current is not None:
            self._users[self.current] += 1
        return self.current

    async def release(self, version: int | None) -> None:
        if version is None:
            return
        self._users[version] -= 1
        if self._users[version] <= 0:
            del self._users[version]
            await self._drop_unused()

    async def _drop_unused(self) -> None:
        for version in sorted(v for v in self._loaded if v != self.current and not self._users[v]):
            self._loaded.discard(version)
            try:
                await self.control("/v1/unload_lora_adapter", {"lora_name": name(version)})
            except Exception as e:  # a server that died holds none: its restart loads the newest only
                log.warning("vllm_adapter_unload_failed", version=version, error=describe(e))
            shutil.rmtree(self.spool / name(version), ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self.spool, ignore_errors=True)


def _copy_adapter(source: Path, target: Path) -> None:
    """Copy a PEFT adapter directory's two files (the weights' link followed) into `target`."""
    target.mkdir(mode=0o700, parents=True, exist_ok=True)
    for f in (adapters.ADAPTER_CONFIG, adapters.ADAPTER_WEIGHTS):
        shutil.copyfile(source / f, target / f)

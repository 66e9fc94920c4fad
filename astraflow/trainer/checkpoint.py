"""Checkpoints that a restart can trust: model, optimizer, scheduler, RNG, version, consumed batches.

The RNG states are every rank's: its CPU generator's and, on CUDA, its device's (`rng.pt`: `ranks`, one
entry per rank; `torch` is rank 0's CPU state, all that checkpoints before per-rank states held).

A checkpoint is written into a temporary directory, every file fsynced, `meta.json` last, then renamed
into place and the parent directory fsynced: a directory named `v<version>` is complete and durable. The
trainer acknowledges a batch and publishes a version only after the checkpoint holding it is durable.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from astraflow.errors import ForeignCheckpointError

META = "meta.json"
MAX_CONSUMED = 100_000
"""Batch uids remembered (the newest): enough to recognise any batch still pending after a crash."""


@dataclass
class TrainerState:
    """What a checkpoint holds of the trainer beside its tensors: where it is and what it trained."""

    version: int = 0
    step: int = 0
    """Optimizer steps taken."""
    consumed: list[str] = field(default_factory=list)
    """Uids of the batches trained into this version."""
    run: str = ""
    """The nonce of the run it belongs to (see `streams.identity`)."""
    last_batch: str = "0-0"
    """Stream id of the newest batch entry trained into it. A batch with a uid in `consumed` and a
    newer id is not the one trained: a Redis that lost its last writes (AOF) may hand out a uid again,
    never an older id."""
    base: str = ""
    """LoRA: the digest of the frozen base the adapter was trained on ('' = full weights)."""
    adapter_config: str = ""
    """LoRA: the adapter's PEFT `adapter_config.json` (what `astraflow export` writes beside it)."""

    def trained(self, uid: str, entry_id: str) -> bool:
        """Whether the batch `uid` delivered as entry `entry_id` is one trained into this state."""
        return uid in self.consumed and entry_order(entry_id) <= entry_order(self.last_batch)

    def add(self, uid: str, entry_id: str) -> None:
        self.consumed.append(uid)
        self.last_batch = max(self.last_batch, entry_id, key=entry_order)


def entry_order(entry_id: str) -> tuple[int, int]:
    ms, seq = entry_id.split("-")
    return int(ms), int(seq)


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """This process's RNG states: the CPU generator's and, when it computes on CUDA, `device`'s."""
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(ranks: list[dict[str, torch.Tensor]], rank: int, device: torch.device) -> None:
    """Set this rank's RNG states from a checkpoint's `ranks`. A rank the checkpoint has no state of
    (it was written by fewer ranks) keeps its own; a CUDA state is set only on CUDA."""
    if rank >= len(ranks):
        return
    state = ranks[rank]
    torch.set_rng_state(state["torch"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(
    root: Path,
    state: TrainerState,
    model_state: dict,
    optim_state: dict,
    scheduler_state: dict,
    rng_states: list[dict[str, torch.Tensor]],
    keep: int,
) -> Path:
    """Write a durable checkpoint `v<version>` under `root` (keeping the newest `keep`); `rng_states` are
    every rank's (`rng_state`), rank 0's first."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"v{state.version:08d}"
    tmp = root / f".tmp-v{state.version:08d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    torch.save(model_state, tmp / "model.pt")
    torch.save({"optimizer": optim_state, "scheduler": scheduler_state}, tmp / "optim.pt")
    torch.save({"torch": rng_states[0]["torch"], "ranks": rng_states}, tmp / "rng.pt")
    meta = {
        "version": state.version,
        "step": state.step,
        "run": state.run,
        "last_batch": state.last_batch,
        "consumed": state.consumed[-MAX_CONSUMED:],
        "base": state.base,
        "adapter_config": state.adapter_config,
    }
    (tmp / META).write_text(json.dumps(meta))
    for f in tmp.iterdir():
        _fsync(f)
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    _fsync(root)
    for old in sorted(p for p in root.glob("v*") if p.is_dir())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest(root: Path) -> Path | None:
    done = sorted(p for p in root.glob("v*") if (p / META).exists()) if root.exists() else []
    return done[-1] if done else None


def load(
    path: Path, run: str, adopt: bool = False, base: str = ""
) -> tuple[TrainerState, dict, dict, dict, list[dict[str, torch.Tensor]]]:
    """(state, model state dict, optimizer state dict, scheduler state dict, every rank's RNG states for
    `restore_rng`; a checkpoint from before per-rank states has rank 0's CPU state only).
    Raises ForeignCheckpointError, before loading anything, for a checkpoint of a run other than `run`
    (a nonce), and for one that names no run (written before runs had a nonce: it could be any run's)
    unless `adopt` - or `adopt_into` wrote this run's nonce into it - and its next checkpoint carries the
    nonce. Also for one whose LoRA base (`TrainerState.base`) is not `base`: an adapter of other weights,
    or full weights where an adapter is trained (and the reverse)."""
    meta = json.loads((path / META).read_text())
    if "run" not in meta and not adopt:
        raise ForeignCheckpointError(
            f"checkpoint {path} names no run (it predates run nonces), so it may be any run's: if it is"
            " this run's, adopt it deliberately (set trainer.adopt_checkpoint), else point"
            " trainer.checkpoint_dir elsewhere"
        )
    if meta.get("run", run) != run:
        raise ForeignCheckpointError(
            f"checkpoint {path} belongs to another run (nonce {meta.get('run')!r}, this run {run!r}):"
            " point trainer.checkpoint_dir at this run's checkpoints, or move that directory away"
        )
    if meta.get("base", "") != base:
        held = f"an adapter of base {meta['base']}" if meta.get("base") else "full weights"
        wanted = f"an adapter of base {base}" if base else "full weights"
        raise ForeignCheckpointError(
            f"checkpoint {path} holds {held}, this trainer trains {wanted} (trainer.lora, trainer.model):"
            " point trainer.checkpoint_dir elsewhere"
        )
    model_state = torch.load(path / "model.pt", weights_only=True)
    # weights_only everywhere: a checkpoint file is data (tensors, numbers, strings, containers - what
    # optimizer, LambdaLR and RNG states are made of), never code that unpickling would run.
    optim = torch.load(path / "optim.pt", weights_only=True)
    rng = torch.load(path / "rng.pt", weights_only=True)
    last_batch = meta.get("last_batch", "0-0")
    state = TrainerState(meta["version"], meta["step"], list(meta["consumed"]), run, last_batch, base)
    state.adapter_config = meta.get("adapter_config", "")
    return state, model_state, optim["optimizer"], optim["scheduler"], rng.get("ranks", [rng])


def adopt_into(path: Path, run: str) -> None:
    """Make a checkpoint that names no run this run's (`run`, a nonce), so that `load` takes it; refuses
    one that names a run already."""
    meta = json.loads((path / META).read_text())
    if "run" in meta:
        raise ForeignCheckpointError(f"checkpoint {path} already names run {meta['run']!r}")
    tmp = path / (META + ".tmp")
    tmp.write_text(json.dumps({**meta, "run": run}))
    _fsync(tmp)
    os.replace(tmp, path / META)

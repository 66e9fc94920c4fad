"""Several ranks for one policy: FSDP2 (`fully_shard`) under `torchrun`, gloo on CPU, NCCL on GPUs.

Rank 0 alone talks to Redis: it reads each batch and hands it to the other ranks (`commands`: they wait
for it outside any collective), checkpoints, acknowledges and publishes. Every rank trains on its share
of the batch's samples; FSDP2 averages the gradients. Why rank 0 alone: a batch is one stream entry, so
one reader keeps the exactly-once bookkeeping (pending list, acknowledgements, checkpointed batch ids)
in one place; the other ranks would only add Redis round trips for bytes rank 0 already has (a batch is
small next to the model's collectives).

The weights leave the ranks two ways: `publication_state` for the weight buffer to take before the next
step (in one process the live tensors; sharded, cast to the served dtype on the device and gathered over
the job's own backend) and `full_model_state` (float32 host copies a checkpoint writes while training
goes on).
"""

from __future__ import annotations

import itertools
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from astraflow.errors import ConfigError
from astraflow.trainer import commands, devices, lora, torch_range
from astraflow.trainer.settings import TrainerSettings

DEFAULT_TIMEOUT_S = 600.0
"""`trainer.collective_timeout_s`'s default (NCCL's own)."""
GATHER_BUCKET_BYTES = 512 << 20
"""Bytes of whole tensors one all-gather of `publication_state` assembles (a tensor larger goes alone):
every rank holds one such buffer while it gathers, rank 0 keeps the whole served state."""
_host_group = None
"""The group for collectives on host memory: gloo beside NCCL (None: the default group is gloo)."""
_heartbeat: commands.RankHeartbeat | None = None
"""Rank 0's sign of life for the other ranks while it is in the job."""


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) without torchrun."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def setup(device: torch.device | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[int, int]:
    """Join the process group when started by torchrun (WORLD_SIZE > 1): NCCL when this rank computes
    on a GPU (`device`, see `devices.resolve`; made the current one), gloo on the CPU. Every collective
    of the job's groups raises after `timeout_s` (`trainer.collective_timeout_s`) instead of hanging;
    rank 0 beats a heartbeat for the others until `teardown` (`commands`)."""
    device = device or torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        global _host_group, _heartbeat
        timeout = timedelta(seconds=timeout_s)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timeout)
        if device.type == "cuda":
            _host_group = dist.new_group(backend="gloo", timeout=timeout)
        if dist.get_rank() == 0:
            _heartbeat = commands.RankHeartbeat(timeout_s)
    return world()


def teardown() -> None:
    """Leave the group once every rank is done (a rank leaving mid-collective aborts gloo at exit)."""
    global _host_group, _heartbeat
    if _heartbeat is not None:
        _heartbeat.stop()
        _heartbeat = None
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()  # every group, the host group too
        _host_group = None


def prepare(model, settings: TrainerSettings, device: torch.device, sharded: bool) -> None:
    """Gradient checkpointing as configured, then the model onto `device`: whole in one process, or
    sharded over the ranks (FSDP2 places each rank's shards on its device)."""
    if settings.gradient_checkpointing:
        # Non-reentrant: works with FSDP2 and with inputs that do not require gradients.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if sharded:
        shard(model, device, devices.DTYPES[settings.dtype])
    else:
        model.to(device)


def shard(model, device: torch.device | None = None, compute_dtype: torch.dtype = torch.float32) -> None:
    """FSDP2 over all ranks, each holding its shards on `device`: each decoder layer its own unit, then the
    rest. The parameters stay float32 (the optimizer's master weights); with a bf16 `compute_dtype` the
    gathered copies the forward and backward use are bf16 and gradients are reduced in float32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if lora.is_adapter(model) and (why := torch_range.lora_sharding_refusal(torch.__version__)):
        raise ConfigError(why)
    device = device or torch.device("cpu")
    # An explicit mesh: FSDP2's default follows the machine's accelerator, not this rank's device.
    mesh = init_device_mesh(device.type, (world()[1],))
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in lora.decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def gather(obj) -> list | None:
    """Every rank's `obj` on rank 0, in rank order (None on the others); `[obj]` in one process. Collective,
    over host memory (tensors in `obj` live on the CPU)."""
    if world()[1] == 1:
        return [obj]
    out = [None] * world()[1] if world()[0] == 0 else None
    dist.gather_object(obj, out, dst=0, group=_host_group)
    return out


def sync_max(n: int) -> int:
    """The largest `n` over the ranks. Collective."""
    if world()[1] == 1:
        return n
    t = torch.tensor([n], device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _collective_device() -> torch.device:
    """Where a tensor for a collective lives: NCCL reduces only GPU tensors."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def is_sharded(model) -> bool:
    """Whether FSDP2 shards `model` (its parameters are DTensors), whatever the world size."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def publication_state(model, dtype: torch.dtype) -> dict:
    """The weights to publish, for the weight buffer to cast and copy at once (before the next step).

    One process: the model's live state dict, no copy (the buffer casts each tensor on its device).
    Sharded (FSDP2, any world size): on rank 0 each tensor whole in `dtype` on this rank's device, empty
    on the others; each rank casts its shards on its device, then all-gathers them a few flat buckets at
    a time over the model's own group (NCCL on GPUs); rank 0 holds the whole served state on its device
    until the buffer took it. Names of one parameter (tied embeddings) map to one tensor object, so the
    layout serves it once. A LoRA model publishes its adapter only (`lora.adapter_state`). Collective."""
    state = _tied(model, model.state_dict())
    if lora.is_adapter(model):
        state = lora.adapter_state(model, state)
    if not is_sharded(model):
        return state
    full: dict[int, torch.Tensor] = {}
    unique = list({id(v): v for v in state.values()}.values())
    for bucket in _buckets(unique, dtype.itemsize):
        full.update(_gather_bucket(bucket, dtype))
    return {k: full[id(v)] for k, v in state.items()} if _rank0() else {}


def _tied(model, state: dict) -> dict:
    """`state` with every name of a parameter (or buffer) tied to an earlier one mapped to the earlier
    name's tensor object. Tied means one Parameter under two names, which every rank sees alike."""
    first: dict[int, str] = {}
    canonical = {}
    named = (model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False))
    for name, tensor in itertools.chain(*named):
        canonical[name] = first.setdefault(id(tensor), name)
    return {k: state[canonical.get(k, k)] for k in state}


def _rows(t) -> tuple[int, int]:
    """(rows per rank, elements per row) of a DTensor FSDP2 splits on dim 0 like `torch.chunk`: the last
    ranks' shards may be shorter or empty; each is padded to the first's rows in a gather."""
    return -(-t.shape[0] // t.device_mesh.size()), t.shape[1:].numel()


def _buckets(tensors: list, itemsize: int) -> list[list]:
    """`tensors` in order, in groups of at most `GATHER_BUCKET_BYTES` whole (one larger tensor alone)."""
    out, current, nbytes = [], [], 0
    for t in tensors:
        size = t.numel() * itemsize
        if current and nbytes + size > GATHER_BUCKET_BYTES:
            out.append(current)
            current, nbytes = [], 0
        current.append(t)
        nbytes += size
    return [*out, current] if current else out


def _gather_bucket(tensors: list, dtype: torch.dtype) -> dict[int, torch.Tensor]:
    """Whole tensors in `dtype` on rank 0 (keyed by `id` of the given tensor; empty on the others): each
    rank casts its dim-0 shards into one flat buffer on its device, padded to equal rows, and one
    all-gather brings every rank's buffer to every rank. Collective over the shards' mesh."""
    from torch.distributed.tensor import DTensor, Shard

    sharded = [t for t in tensors if isinstance(t, DTensor)]
    for t in sharded:
        if tuple(t.placements) != (Shard(0),):
            raise ValueError(f"placements {t.placements}, expected FSDP's (Shard(0),)")
    plain = [t for t in tensors if not isinstance(t, DTensor)]  # not sharded (a buffer): whole on each rank
    out = {id(t): t.detach().to(dtype) if t.is_floating_point() else t for t in plain} if _rank0() else {}
    if not sharded:
        return out
    mesh = sharded[0].device_mesh
    sizes = [rows * width for rows, width in map(_rows, sharded)]
    local = torch.empty(sum(sizes), dtype=dtype, device=sharded[0].to_local().device)
    offset = 0
    for t, n in zip(sharded, sizes, strict=True):
        shard = t.to_local().detach().reshape(-1)
        local[offset : offset + shard.numel()].copy_(shard)  # the cast, on the device
        local[offset + shard.numel() : offset + n].zero_()  # padding rows
        offset += n
    gathered = local.new_empty(mesh.size() * local.numel())
    dist.all_gather_into_tensor(gathered, local, group=mesh.get_group())
    if not _rank0():
        return out
    per_rank, offset = gathered.view(mesh.size(), -1), 0
    for t, n in zip(sharded, sizes, strict=True):
        rows, _ = _rows(t)
        whole = per_rank[:, offset : offset + n].reshape(mesh.size() * rows, *t.shape[1:])
        if whole.untyped_storage().data_ptr() == gathered.untyped_storage().data_ptr():
            whole = whole.clone()  # a view (one rank): each tensor its own storage, or the layout ties them
        out[id(t)] = whole[: t.shape[0]]
        offset += n
    return out


def _rank0() -> bool:
    return world()[0] == 0


def full_model_state(model) -> dict:
    """A copy of the whole float32 model state dict on rank 0 (on CPU; later steps do not change it; tied
    names share one copy); empty on the others. Sharded, each rank copies its own shards into host
    memory (from a GPU asynchronously, into pinned memory, all ranks at once); rank 0 assembles them.
    For checkpoints: no optimizer state moves. A LoRA model's: its trainable (adapter) parameters only, the
    frozen base is the starting weights. Collective."""
    state = _checkpointed(model)
    if not is_sharded(model):
        return devices.to_host(state)
    from torch.distributed.tensor import DTensor, Shard

    state = _tied(model, state)
    unique = list({id(v): v for v in state.values()}.values())
    for v in unique:
        if isinstance(v, DTensor) and tuple(v.placements) != (Shard(0),):
            raise ValueError(f"placements {v.placements}, expected FSDP's (Shard(0),)")
    local = devices.to_host([v.to_local() if isinstance(v, DTensor) else v for v in unique])
    full = {
        id(v): _gather_rows(part, v.shape) if isinstance(v, DTensor) else part
        for v, part in zip(unique, local, strict=True)
    }
    return {k: full[id(v)] for k, v in state.items()} if _rank0() else {}


def _checkpointed(model) -> dict:
    """The state dict a checkpoint holds: the whole model's, or a LoRA model's trainable parameters."""
    state = model.state_dict()
    if lora.is_adapter(model):
        trainable = lora.trainable_names(model)
        state = {k: v for k, v in state.items() if k in trainable}
    return state


def _gather_rows(shard: torch.Tensor, shape: torch.Size) -> torch.Tensor | None:
    """The whole tensor of `shape` on rank 0 from each rank's dim-0 shard (`torch.chunk`'s split: the
    last ranks' shards may be shorter or empty); None on the others. Collective on host memory."""
    rank, size = world()
    if size == 1:  # one rank holds every row (and NCCL's group of one has no host group beside it)
        return shard
    rows = -(-shape[0] // size)
    padded = shard.new_zeros((rows, *shape[1:]))
    padded[: shard.shape[0]] = shard
    parts = [torch.empty_like(padded) for _ in range(size)] if rank == 0 else None
    dist.gather(padded, parts, dst=0, group=_host_group)
    return torch.cat(parts)[: shape[0]] if parts is not None else None


def full_optimizer_state(model, optimizer) -> dict:
    """A copy of the whole optimizer state dict on rank 0. Collective."""
    if not is_sharded(model):
        return devices.to_host(optimizer.state_dict())
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(model, optimizer, options=options)


def load_full_state(model, optimizer, model_state: dict, optim_state: dict) -> None:
    """Load full state dicts that rank 0 read from a checkpoint into every rank's shards (a LoRA model's:
    its adapter, `lora.check_restorable` on rank 0). Collective."""
    adapter = lora.is_adapter(model)
    if adapter and _rank0():
        lora.check_restorable(model, model_state)
    if not is_sharded(model):
        model.load_state_dict(model_state, strict=not adapter)
        optimizer.load_state_dict(optim_state)
        return
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=True, cpu_offload=True, strict=not adapter
    )
    set_model_state_dict(model, model_state, options=options)
    set_optimizer_state_dict(model, optimizer, optim_state, options=options)

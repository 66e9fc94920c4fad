"""Several ranks for one policy: FSDP2 (`fully_shard`) under `torchrun`, gloo on CPU, NCCL on GPUs.

Rank 0 alone talks to Redis: it reads each batch and broadcasts it, checkpoints, acknowledges and
publishes. Every rank trains on its share of the batch's samples; FSDP2 averages the gradients. Why
rank 0 alone: a batch is one stream entry, so one reader keeps the exactly-once bookkeeping (pending
list, acknowledgements, checkpointed batch ids) in one place; the other ranks would only add Redis
round trips for bytes rank 0 already has (a batch is small next to the model's collectives).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from astraflow.trainer import devices

_host_group = None
"""The group for collectives on host memory: gloo beside NCCL (None: the default group is gloo)."""


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) without torchrun."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def setup(device: torch.device | None = None) -> tuple[int, int]:
    """Join the process group when started by torchrun (WORLD_SIZE > 1): NCCL when this rank computes
    on a GPU (`device`, see `devices.resolve`; made the current one), gloo on the CPU."""
    device = device or torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        global _host_group
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        if device.type == "cuda":
            _host_group = dist.new_group(backend="gloo")
    return world()


def teardown() -> None:
    """Leave the group once every rank is done (a rank leaving mid-collective aborts gloo at exit)."""
    global _host_group
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()  # every group, the host group too
        _host_group = None


def shard(model, device: torch.device | None = None, compute_dtype: torch.dtype = torch.float32) -> None:
    """FSDP2 over all ranks, each holding its shards on `device`: each decoder layer its own unit, then the
    rest. The parameters stay float32 (the optimizer's master weights); with a bf16 `compute_dtype` the
    gathered copies the forward and backward use are bf16 and gradients are reduced in float32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device = device or torch.device("cpu")
    # An explicit mesh: FSDP2's default follows the machine's accelerator, not this rank's device.
    mesh = init_device_mesh(device.type, (world()[1],))
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def broadcast(obj=None):
    """Rank 0's `obj` on every rank (pickled by torch.distributed between our own ranks only)."""
    if world()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


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


def full_model_state(model) -> dict:
    """A copy of the whole model state dict on rank 0 (on CPU; later steps do not change it); empty on
    the others. Each rank copies its own shards into host memory (from a GPU asynchronously, into
    pinned memory, all ranks at once); rank 0 assembles them. No optimizer state moves. Collective."""
    if world()[1] == 1:
        return devices.to_host(model.state_dict())
    from torch.distributed.tensor import DTensor, Shard

    state = model.state_dict()
    for name, v in state.items():
        if isinstance(v, DTensor) and tuple(v.placements) != (Shard(0),):
            raise ValueError(f"{name}: placements {v.placements}, expected FSDP's (Shard(0),)")
    local = devices.to_host({k: v.to_local() if isinstance(v, DTensor) else v for k, v in state.items()})
    full = {
        k: _gather_rows(local[k], v.shape) if isinstance(v, DTensor) else local[k] for k, v in state.items()
    }
    return full if world()[0] == 0 else {}


def _gather_rows(shard: torch.Tensor, shape: torch.Size) -> torch.Tensor | None:
    """The whole tensor of `shape` on rank 0 from each rank's dim-0 shard (`torch.chunk`'s split: the
    last ranks' shards may be shorter or empty); None on the others. Collective on host memory."""
    rank, size = world()
    rows = -(-shape[0] // size)
    padded = shard.new_zeros((rows, *shape[1:]))
    padded[: shard.shape[0]] = shard
    parts = [torch.empty_like(padded) for _ in range(size)] if rank == 0 else None
    dist.gather(padded, parts, dst=0, group=_host_group)
    return torch.cat(parts)[: shape[0]] if parts is not None else None


def full_optimizer_state(model, optimizer) -> dict:
    """A copy of the whole optimizer state dict on rank 0. Collective."""
    if world()[1] == 1:
        return devices.to_host(optimizer.state_dict())
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(model, optimizer, options=options)


def load_full_state(model, optimizer, model_state: dict, optim_state: dict) -> None:
    """Load full state dicts that rank 0 read from a checkpoint into every rank's shards. Collective."""
    if world()[1] == 1:
        model.load_state_dict(model_state)
        optimizer.load_state_dict(optim_state)
        return
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, cpu_offload=True)
    set_model_state_dict(model, model_state, options=options)
    set_optimizer_state_dict(model, optimizer, optim_state, options=options)

"""One training step of the tiny model under torchrun (FSDP2; gloo on the CPU, NCCL on CUDA):
`torchrun --nproc_per_node N -m tests.fsdp_step MODEL_DIR OUT.pt [cpu|cuda] [shard] [lora]` saves the full
state after the step (rank 0: the float32 state a checkpoint holds; beside it, `served_path(OUT)`, the
bf16 tensors the weight buffer serves from the publication state), after checking that the state
assembled from the ranks' shards is the one torch gathers. Without torchrun it is the one-process
reference; `shard` shards even a single rank (FSDP2 on one GPU); `lora` trains a LoRA adapter of the
model (its state: the adapter's)."""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from astraflow.trainer import distributed, lora
from astraflow.trainer.settings import LoraSettings, TrainerSettings
from astraflow.trainer.step import PolicyTrainer
from tests.trainer_helpers import make_batch

SEQS = [[5, 6, 7, 8, 9], [5, 6, 10], [5, 6, 13, 14], [5, 6, 15, 16, 17, 18], [5, 6, 19, 20, 21]]
REWARDS = [1, 0, 0.5, 0, 1]


def main(
    model_dir: str, out: str, device: str = "cpu", force_shard: bool = False, adapter: bool = False
) -> None:
    local = int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device(device, local) if device == "cuda" else torch.device("cpu")
    rank, size = distributed.setup(dev)
    if force_shard and not dist.is_initialized():  # FSDP2 over a group of one (setup joins only for 2+)
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    batch = make_batch(model, SEQS, REWARDS)  # behaviour logprobs from the unsharded starting model
    sharded = size > 1 or force_shard
    if force_shard:  # a persistent buffer: a tensor FSDP2 leaves whole, gathered and published all the same
        model.model.register_buffer("scale", torch.linspace(0, 1, 8), persistent=True)
    adapter_settings = LoraSettings(rank=2, alpha=4, base_dtype="float32") if adapter else None
    if adapter:
        torch.manual_seed(0)  # the same initial adapter in every process
        model = lora.wrap(model, adapter_settings)
    if sharded:
        distributed.shard(model, dev)
    else:
        model.to(dev)
    # The distributed path computes every sample whole (no shared prompts): the reference does too.
    settings = TrainerSettings(
        lr=1e-3, micro_batch_tokens=12, minibatches=2, share_prefix=False, lora=adapter_settings
    )
    trainer = PolicyTrainer(model, settings)
    trainer.step(batch)
    state = distributed.full_model_state(model)  # a checkpoint's: float32 host copies
    served = distributed.publication_state(model, torch.bfloat16)  # what publication hands the buffer
    if sharded:  # the shards each rank copied, assembled: what torch's own full gather gives, exactly
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        reference = get_model_state_dict(model, options=options)
        if adapter:  # a checkpoint holds the adapter: the frozen base is the starting weights
            reference = {k: v for k, v in reference.items() if k in lora.trainable_names(model)}
        if rank == 0:
            assert state.keys() == reference.keys()
            for k, v in reference.items():
                assert state[k].shape == v.shape and torch.equal(state[k], v), k
    if rank == 0:
        assert all(not hasattr(v, "to_local") for v in [*state.values(), *served.values()])
        assert adapter or state["lm_head.weight"] is state["model.embed_tokens.weight"]  # ties kept
        torch.save(state, out)
        torch.save(publish(served, Path(out).with_suffix(".buffer")), served_path(out))
    distributed.teardown()  # leave the group before exit, or gloo's threads may abort the process


def served_path(out) -> Path:
    return Path(out).with_suffix(".served.pt")


def publish(state: dict, root: Path) -> dict:
    """The bf16 tensors the weight buffer serves after writing `state` (the trainer's publication path)."""
    from safetensors.torch import load_file

    from astraflow.weights import layout
    from astraflow.weights.buffer import DoubleBuffer

    buffer = DoubleBuffer(root, layout.layout(state, "bfloat16"))
    try:
        return load_file(buffer.write_state(state).path)
    finally:
        buffer.close()


if __name__ == "__main__":
    flags = sys.argv[4:]
    main(sys.argv[1], sys.argv[2], *sys.argv[3:4], force_shard="shard" in flags, adapter="lora" in flags)

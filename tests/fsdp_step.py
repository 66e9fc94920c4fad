"""One training step of the tiny model under torchrun (FSDP2 on gloo): `torchrun --nproc_per_node N -m
tests.fsdp_step MODEL_DIR OUT.pt` saves the full parameters after the step (rank 0), after checking that
the state assembled from the ranks' shards is the one torch gathers."""

import sys

import torch
from transformers import AutoModelForCausalLM

from astraflow.trainer import distributed
from astraflow.trainer.settings import TrainerSettings
from astraflow.trainer.step import PolicyTrainer
from tests.trainer_helpers import make_batch

SEQS = [[5, 6, 7, 8, 9], [5, 6, 10], [5, 6, 13, 14], [5, 6, 15, 16, 17, 18], [5, 6, 19, 20, 21]]
REWARDS = [1, 0, 0.5, 0, 1]


def main(model_dir: str, out: str) -> None:
    rank, size = distributed.setup()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    batch = make_batch(model, SEQS, REWARDS)  # behaviour logprobs from the unsharded starting model
    if size > 1:
        distributed.shard(model)
    # The distributed path computes every sample whole (no shared prompts): the reference does too.
    settings = TrainerSettings(lr=1e-3, micro_batch_tokens=12, minibatches=2, share_prefix=False)
    trainer = PolicyTrainer(model, settings)
    trainer.step(batch)
    state = distributed.full_model_state(model)
    if size > 1:  # the shards each rank copied, assembled: what torch's own full gather gives, exactly
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        reference = get_model_state_dict(model, options=options)
        if rank == 0:
            assert state.keys() == reference.keys()
            for k, v in reference.items():
                assert state[k].shape == v.shape and torch.equal(state[k], v), k
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in state.items()}, out)
    distributed.teardown()  # leave the group before exit, or gloo's threads may abort the process


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

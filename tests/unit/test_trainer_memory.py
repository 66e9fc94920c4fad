"""A trainer holds no gradients between steps: at the 0.5B shape they are 2 GB of a CPU trainer's ~9 GB
while it publishes and waits for its next batch (tests/bench/real_shape_run.py saw it killed for memory
there)."""

import torch

from astraflow.trainer.settings import TrainerSettings
from tests.trainer_helpers import make_batch


def test_gradients_are_freed_once_applied(tiny_model):
    from transformers import AutoModelForCausalLM

    from astraflow.trainer.step import PolicyTrainer

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = PolicyTrainer(model, TrainerSettings(lr=1e-3, minibatches=2))
    batch = make_batch(model, [[5, 6, 7, 8], [5, 6, 9], [5, 6, 10, 11], [5, 6, 12]], [1, 0, 1, 0])
    assert "skipped" not in trainer.step(batch)
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))  # applied
    assert all(p.grad is None for p in model.parameters())

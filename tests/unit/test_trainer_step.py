"""A training step on a tiny model: it moves probability toward positive advantages, and splitting the
batch into micro-batches (gradient accumulation) gives the same update as one big micro-batch."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest

from astraflow.trainer.batching import micro_batches, samples, token_logprobs
from astraflow.trainer.settings import TrainerSettings
from tests.trainer_helpers import make_batch

torch = pytest.importorskip("torch")


@pytest.fixture
def model(tiny_model):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


def seq_logprob(model, batch, i):
    mb = micro_batches(samples(batch), 10_000)[0]
    with torch.no_grad():
        logp, _ = token_logprobs(model, mb)
    order = sorted(range(len(samples(batch))), key=lambda k: -len(samples(batch)[k].tokens))
    row = order.index(i)
    return float((logp[row] * mb.mask[row]).sum())


def test_a_step_moves_probability_toward_positive_advantages(model):
    from astraflow.trainer.step import PolicyTrainer

    seqs = [[5, 6, 7, 8, 9], [5, 6, 10, 11, 12], [5, 6, 13, 14], [5, 6, 15, 16, 17, 18]]
    batch = make_batch(model, seqs, [1, 0, 1, 0])
    before = [seq_logprob(model, batch, i) for i in range(4)]
    trainer = PolicyTrainer(model, TrainerSettings(lr=1e-3, grad_clip=None))
    import resource

    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    for _ in range(3):
        stats = trainer.step(batch)
    after = [seq_logprob(model, batch, i) for i in range(4)]
    assert after[0] > before[0] and after[2] > before[2]  # rewarded
    assert after[1] < before[1] and after[3] < before[3]  # not rewarded
    assert stats["tokens"] == 3 + 3 + 2 + 4  # the completion tokens
    assert {"loss", "clip_frac", "entropy", "grad_norm", "staleness_mean", "tokens_per_s"} <= set(stats)
    assert stats["peak_memory_gib"] * 2**30 >= rss_before > 0  # on the CPU: the process's peak RSS


def test_micro_batches_accumulate_to_the_same_update(model):
    from astraflow.trainer.step import PolicyTrainer

    batch = make_batch(
        model, [[5, 6, 7, 8, 9], [5, 6, 10], [5, 6, 13, 14], [5, 6, 15, 16, 17, 18]], [1, 0, 0.5, 0]
    )
    results = []
    for tokens in (10_000, 6):  # one micro-batch, or one sequence each
        m = copy.deepcopy(model)
        trainer = PolicyTrainer(m, TrainerSettings(micro_batch_tokens=tokens, grad_clip=None))
        trainer.optimizer = torch.optim.SGD(m.parameters(), lr=1.0)  # the update is the gradient itself
        trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda s: 1.0)
        trainer.step(batch)
        results.append(torch.cat([p.detach().flatten() for p in m.parameters()]))
    assert len(micro_batches(samples(batch), 6)) == 4
    assert torch.allclose(results[0], results[1], atol=1e-5)


def test_shared_prefix_gives_the_plain_update(model):
    """Samples of one prompt share its forward: same logprobs, same gradient, as each computed alone
    (prompts of different lengths, a trained span with an untrained token inside, one-token answers)."""
    from astraflow.trainer.batching import Sample
    from astraflow.trainer.step import PolicyTrainer

    seqs = [[5, 6, 7, 8, 9], [5, 6, 10], [5, 6, 13, 14], [3, 4, 5, 6, 15, 16, 17, 18], [3, 4, 5, 6, 19]]
    batch = make_batch(model, seqs, [1, 0, 0.5, 0, 1])
    items = samples(batch)
    items[3] = Sample(items[3].tokens, items[3].behav, np.array([0, 0, 0, 0, 1, 0, 1, 1], np.uint8), 0.3, 0)
    items[:] = [s if i != 4 else Sample(s.tokens, s.behav, np.array([0, 0, 0, 0, 1], np.uint8), -1.0, 0)
                for i, s in enumerate(items)]  # fmt: skip
    shared = micro_batches(items, 10_000, share_prefix=True)
    plain = micro_batches(items, 10_000)
    assert type(shared[0]).__name__ == "SharedMicroBatch" and len(shared[0].prefix_ids) == 2

    def total(mbs):  # sum over trained tokens of advantage x logprob, and its gradient
        model.zero_grad()
        value = sum(((token_logprobs(model, mb)[0] * mb.adv) * mb.mask).sum() for mb in mbs)
        value.backward()
        grads = [p.grad.flatten() for p in model.parameters() if p.grad is not None]
        return float(value.detach()), torch.cat(grads)

    (a, grad_a), (b, grad_b) = total(shared), total(plain)
    assert a == pytest.approx(b, abs=1e-4)
    assert torch.allclose(grad_a, grad_b, atol=1e-5)

    updated = []
    for share in (True, False):  # and a whole step, through PolicyTrainer
        m = copy.deepcopy(model)
        trainer = PolicyTrainer(m, TrainerSettings(share_prefix=share, grad_clip=None))
        trainer.step(batch)
        updated.append(torch.cat([p.detach().flatten() for p in m.parameters()]))
    assert torch.allclose(updated[0], updated[1], atol=1e-5)


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def at(values: np.ndarray, i: int, value) -> np.ndarray:
    out = values.copy()
    out[i] = value
    return out


SEQS = [[5, 6, 7, 8, 9], [5, 6, 10, 11, 12], [5, 6, 13, 14], [5, 6, 15, 16, 17, 18]]


def nan_advantage(model):
    batch = make_batch(model, SEQS, [1, 0, 1, 0])
    group = dataclasses.replace(batch.groups[0], advantages=at(batch.groups[0].advantages, 2, np.nan))
    return dataclasses.replace(batch, groups=[group]), "sample 2: advantage nan is not finite"


def nan_behaviour_logprob(model):
    spoil = lambda i, t: dataclasses.replace(t, logprobs=at(t.logprobs, 3, np.nan)) if i == 1 else t  # noqa: E731
    return make_batch(model, SEQS, [1, 0, 1, 0], spoil), "sample 1: behaviour logprobs are not finite"


def token_outside_the_vocabulary(model):
    vocab = model.get_input_embeddings().num_embeddings
    spoil = lambda i, t: dataclasses.replace(t, token_ids=at(t.token_ids, 3, vocab)) if i == 0 else t  # noqa: E731
    return make_batch(
        model, SEQS, [1, 0, 1, 0], spoil
    ), f"token id {vocab} outside the embedding [0, {vocab})"


@pytest.mark.parametrize("spoiled", [nan_advantage, nan_behaviour_logprob, token_outside_the_vocabulary])
def test_a_batch_with_non_finite_or_out_of_range_values_leaves_the_weights_bit_identical(model, spoiled):
    from astraflow.trainer.step import PolicyTrainer

    trainer = PolicyTrainer(model, TrainerSettings(lr=1e-2))
    before = weights(model)
    batch, reason = spoiled(model)
    assert trainer.step(batch) == {"skipped": 1.0}
    assert reason in trainer.skipped
    after = weights(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(torch.isfinite(v).all() for v in after.values())
    assert trainer.scheduler.last_epoch == 0 and not trainer.optimizer.state  # neither stepped
    trainer.step(make_batch(model, SEQS, [1, 0, 1, 0]))  # the next good batch trains
    assert trainer.skipped is None
    assert any(not torch.equal(before[k], v) for k, v in weights(model).items())


@pytest.mark.parametrize("minibatches", [1, 2])
def test_a_step_whose_loss_is_nan_is_not_applied(model, minibatches):
    from astraflow.trainer.step import PolicyTrainer

    trainer = PolicyTrainer(model, TrainerSettings(lr=1e-2, minibatches=minibatches))
    before = weights(model)
    batch = make_batch(model, SEQS, [1, 0, 1, 0])

    def nan_logits(module, args, output):  # a numerical blow-up in the forward
        output.logits = output.logits * float("nan")
        return output

    hook = model.register_forward_hook(nan_logits)
    try:
        assert trainer.step(batch) == {"skipped": 1.0}
    finally:
        hook.remove()
    assert "minibatch 0: loss nan or gradient norm nan is not finite" == trainer.skipped
    after = weights(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in model.parameters())  # nothing left to leak into the next step
    assert trainer.scheduler.last_epoch == 0 and not trainer.optimizer.state


def test_staleness_counts_from_the_version_the_trainer_holds(model):
    """A batch formed for version 0 and trained at version 3 (batches were prefetched meanwhile) is 3
    versions stale, not 0."""
    from astraflow.trainer.step import PolicyTrainer

    batch = make_batch(model, [[5, 6, 7, 8], [5, 6, 9, 10]], [1, 0])  # formed for version 0, tokens of 0
    trainer = PolicyTrainer(model, TrainerSettings())
    assert trainer.step(batch)["staleness_max"] == 0.0
    stats = trainer.step(batch, version=3)
    assert stats["staleness_max"] == stats["staleness_mean"] == 3.0 and stats["staleness_3"] == 1.0

"""A LoRA policy's trainer: a step moves the adapter and leaves the frozen base bit for bit, the optimizer
holds the adapter only, a version is the adapter's tensors; a checkpoint holds the adapter and its
optimizer state and resumes it exactly, and refuses a checkpoint of another base (or of full weights)."""

from __future__ import annotations

import pytest

from astraflow.errors import ForeignCheckpointError
from astraflow.trainer import checkpoint, distributed, lora
from astraflow.trainer.settings import LoraSettings, TrainerSettings
from astraflow.weights import adapters
from tests.trainer_helpers import make_batch

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.timeout(120)
SEQS = [[5, 6, 7, 8, 9], [5, 6, 10, 11, 12], [5, 6, 13, 14], [5, 6, 15, 16, 17, 18]]
SETTINGS = TrainerSettings(lr=1e-2, lora=LoraSettings(rank=2, alpha=4, base_dtype="float32"))


def policy(model_dir: str):
    from transformers import AutoModelForCausalLM

    from astraflow.trainer.step import PolicyTrainer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return PolicyTrainer(lora.wrap(model, SETTINGS.lora), SETTINGS)


def test_a_step_trains_the_adapter_and_leaves_the_base(tiny_model):
    p = policy(tiny_model)
    base = {k: v.clone() for k, v in p.model.state_dict().items() if "lora_" not in k}
    batch = make_batch(p.model, SEQS, [1, 0, 1, 0])
    for _ in range(2):
        p.step(batch)
    after = p.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base.items())
    adapter = [v for k, v in after.items() if "lora_B" in k]
    assert adapter and all(v.abs().sum() > 0 for v in adapter)  # B starts at zero: it moved
    held = {id(q) for group in p.optimizer.param_groups for q in group["params"]}
    assert held == {id(q) for n, q in p.model.named_parameters() if "lora_" in n}
    published = distributed.publication_state(p.model, torch.bfloat16)
    assert published and all(".lora_A." in k or ".lora_B." in k for k in published)
    assert not any(".default." in k for k in published)  # PEFT's saved names, as adapter files hold


def test_a_checkpoint_resumes_the_adapter_and_refuses_another_base(tmp_path, tiny_model, tiny_model_v2):
    p = policy(tiny_model)
    batch = make_batch(p.model, SEQS, [1, 0, 1, 0])
    p.step(batch)
    digest = adapters.base_digest(tiny_model)
    state = checkpoint.TrainerState(version=1, step=1, run="n1", base=digest)
    model_state = distributed.full_model_state(p.model)
    assert set(model_state) == lora.trainable_names(p.model)  # the adapter only, not the frozen base
    optim_state = distributed.full_optimizer_state(p.model, p.optimizer)
    path = checkpoint.save(tmp_path, state, model_state, optim_state, {}, [checkpoint.rng_state(p.device)], 2)

    resumed = policy(tiny_model)
    loaded = checkpoint.load(path, "n1", base=digest)
    distributed.load_full_state(resumed.model, resumed.optimizer, loaded[1], loaded[2])
    p.step(batch)  # the same next step from both: the same adapter, moments and all
    resumed.step(batch)
    a, b = p.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)

    assert adapters.base_digest(tiny_model_v2) != digest
    with pytest.raises(ForeignCheckpointError, match="an adapter of base"):
        checkpoint.load(path, "n1", base=adapters.base_digest(tiny_model_v2))
    with pytest.raises(ForeignCheckpointError, match="full weights"):
        checkpoint.load(path, "n1")  # a full fine-tune does not resume from an adapter


def test_the_base_digest_is_of_the_weights_not_their_files(tiny_model, tiny_model_sharded, tiny_model_v2):
    assert adapters.base_digest(tiny_model) == adapters.base_digest(tiny_model_sharded)
    assert adapters.base_digest(tiny_model) != adapters.base_digest(tiny_model_v2)


def test_lora_plus_gives_the_b_matrices_their_own_learning_rate(tiny_model):
    from transformers import AutoModelForCausalLM

    from astraflow.trainer.step import PolicyTrainer

    settings = SETTINGS.model_copy(update={"lora": SETTINGS.lora.model_copy(update={"b_lr_ratio": 16.0})})
    model = lora.wrap(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), settings.lora)
    p = PolicyTrainer(model, settings)
    names = {id(q): n for n, q in model.named_parameters()}
    lrs = {
        ("lora_B" in names[id(q)], group["lr"]) for group in p.optimizer.param_groups for q in group["params"]
    }
    assert lrs == {(False, settings.lr), (True, 16 * settings.lr)}


def test_the_kl_reference_of_a_lora_policy_is_its_base(tiny_model):
    from transformers import AutoModelForCausalLM

    from astraflow.trainer.settings import LossSettings
    from astraflow.trainer.step import PolicyTrainer

    settings = SETTINGS.model_copy(update={"loss": LossSettings(kl_coef=0.1)})
    model = lora.wrap(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), settings.lora)
    p = PolicyTrainer(model, settings)
    assert p.ref is None  # no copy of the base: the adapter switched off
    batch = make_batch(model, SEQS, [1, 0, 1, 0])
    first = p.step(batch)["kl"]
    later = [p.step(batch)["kl"] for _ in range(2)][-1]
    assert abs(first) < 1e-6 < later  # the adapter starts as the base, then moves away from it

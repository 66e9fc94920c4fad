"""The trainer's device and precision: the device it resolves (or refuses), bf16 compute over float32
master weights, gradient checkpointing; on the CPU through the same code that runs on a GPU."""

from __future__ import annotations

import copy

import pytest

from astraflow.errors import ConfigError
from astraflow.trainer.settings import TrainerSettings
from tests.trainer_helpers import make_batch

torch = pytest.importorskip("torch")

SEQS = [[5, 6, 7, 8, 9], [5, 6, 10, 11, 12], [5, 6, 13, 14], [5, 6, 15, 16, 17, 18]]
REWARDS = [1, 0, 1, 0]


@pytest.fixture
def model(tiny_model):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


def gpus(monkeypatch, n: int, local_rank: int = 0, local_ranks: int = 1) -> None:
    """This process as torchrun's local rank `local_rank` of `local_ranks`, on a machine with `n` GPUs."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_ranks))


def test_the_device_is_the_ranks_own_gpu_or_the_cpu(monkeypatch):
    from astraflow.trainer.devices import resolve

    gpus(monkeypatch, 0)
    assert resolve(TrainerSettings()) == torch.device("cpu")  # auto, no GPU
    gpus(monkeypatch, 2, local_rank=1, local_ranks=2)
    assert resolve(TrainerSettings()) == torch.device("cuda", 1)
    assert resolve(TrainerSettings(device="cpu")) == torch.device("cpu")
    gpus(monkeypatch, 1, local_rank=1, local_ranks=2)
    assert resolve(TrainerSettings()) == torch.device("cpu")  # auto: not every rank has a GPU
    with pytest.raises(ConfigError, match="local rank 1"):
        resolve(TrainerSettings(device="cuda"))


def test_cuda_requested_without_cuda_fails_at_start_with_the_reason(monkeypatch, bus, tmp_path):
    from astraflow.launch.build import build_trainer
    from astraflow.settings_load import load_settings

    gpus(monkeypatch, 0)
    settings = load_settings(None, [f"trainer.model={tmp_path}", "trainer.device=cuda"])  # (no weights in it)
    with pytest.raises(ConfigError, match=r"trainer.device is 'cuda'.*0 CUDA device"):
        build_trainer(settings, bus, "policy")  # before it loads any weights


def test_a_bf16_step_on_the_cpu_computes_in_bf16_keeps_float32_weights_and_lowers_the_loss(model):
    from astraflow.trainer import devices, distributed
    from astraflow.trainer.step import PolicyTrainer

    batch = make_batch(model, SEQS, REWARDS)
    settings = TrainerSettings(device="cpu", dtype="bfloat16", lr=1e-3, grad_clip=None)
    distributed.prepare(model, settings, devices.resolve(settings), sharded=False)
    seen = []
    model.lm_head.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    trainer = PolicyTrainer(model, settings)
    losses = [trainer.step(batch)["loss"] for _ in range(3)]
    assert set(seen) == {torch.bfloat16}
    assert losses[2] < losses[0]
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    state = trainer.optimizer.state_dict()["state"]
    assert {s["exp_avg"].dtype for s in state.values()} == {torch.float32}


def test_gradient_checkpointing_gives_the_same_update(model):
    from astraflow.trainer import distributed
    from astraflow.trainer.step import PolicyTrainer

    batch = make_batch(model, SEQS, REWARDS)
    updated = []
    for checkpointing in (False, True):
        m = copy.deepcopy(model)
        settings = TrainerSettings(device="cpu", gradient_checkpointing=checkpointing, grad_clip=None)
        distributed.prepare(m, settings, torch.device("cpu"), sharded=False)
        assert m.is_gradient_checkpointing == checkpointing
        PolicyTrainer(m, settings).step(batch)
        updated.append(torch.cat([p.detach().flatten() for p in m.parameters()]))
    assert not torch.equal(updated[0], torch.cat([p.flatten() for p in model.parameters()]))
    assert torch.allclose(updated[0], updated[1], atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_bf16_step_on_the_gpu_trains_and_copies_its_state_to_host_memory(model):
    from astraflow.trainer import devices, distributed
    from astraflow.trainer.step import PolicyTrainer

    batch = make_batch(model, SEQS, REWARDS)
    settings = TrainerSettings(device="cuda", dtype="bfloat16", lr=1e-3, grad_clip=1.0)
    device = devices.resolve(settings)
    distributed.prepare(model, settings, device, sharded=False)
    trainer = PolicyTrainer(model, settings)
    losses = [trainer.step(batch)["loss"] for _ in range(3)]
    assert losses[2] < losses[0]
    state = distributed.full_model_state(model)
    assert all(not v.is_cuda and v.is_pinned() and v.dtype == torch.float32 for v in state.values())
    before = {k: v.clone() for k, v in state.items()}
    trainer.step(batch)  # a later step leaves the copy as it was
    assert all(torch.equal(before[k], state[k]) for k in state)
    assert any(not torch.equal(before[k], v.cpu()) for k, v in model.state_dict().items())
    optim = distributed.full_optimizer_state(model, trainer.optimizer)
    assert all(not s["exp_avg"].is_cuda for s in optim["state"].values())


def test_tied_embeddings_are_published_once_and_stay_tied_in_host_copies(model):
    """The tiny model ties `lm_head.weight` to the embeddings, as Qwen2.5-0.5B/1.5B do: the layout of the
    publication state serves the pair once (not +15-28% of bytes for nothing), and the host copy a
    checkpoint takes keeps one tensor for both names."""
    from astraflow.trainer import devices, distributed
    from astraflow.weights import layout

    state = distributed.publication_state(model, torch.bfloat16)
    names = [s.name for s in layout.layout(state, "bfloat16")]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert state["lm_head.weight"] is state["model.embed_tokens.weight"]
    live = dict(model.named_parameters())["model.embed_tokens.weight"]
    assert state["lm_head.weight"].data_ptr() == live.data_ptr()  # live: no copy to publish in one process

    host = devices.to_host(model.state_dict())
    assert host["lm_head.weight"] is host["model.embed_tokens.weight"]
    assert host["lm_head.weight"].data_ptr() != live.data_ptr()  # a copy, one for both names
    assert host.keys() == model.state_dict().keys()
    assert [s.name for s in layout.layout(host, "bfloat16")] == names

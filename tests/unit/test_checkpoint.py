"""Trainer checkpoints: they round-trip (model, optimizer, scheduler, every rank's CPU and CUDA RNG, run,
trained batches) with every file loaded `weights_only`; one written before per-rank RNG states loads; a
pickle payload in one is refused unrun; a checkpoint of another run is refused; a batch uid handed out
again after Redis lost its last writes is not taken as trained."""

import asyncio
import pickle

import pytest
import torch

from astraflow.errors import ForeignCheckpointError
from astraflow.trainer import checkpoint
from astraflow.trainer.checkpoint import TrainerState

pytestmark = pytest.mark.timeout(60)
CPU = torch.device("cpu")


def trained_model():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99))
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / 10))
    for _ in range(2):
        model(torch.randn(4, 3)).sum().backward()
        optim.step()
        sched.step()
    return model, optim, sched


def save(root, run: str = "n1"):
    model, optim, sched = trained_model()
    state = TrainerState(version=2, step=2, run=run)
    state.add("policy:n1:1", "5-0")
    state.add("policy:n1:2", "9-1")
    rng = checkpoint.rng_state(CPU)
    path = checkpoint.save(root, state, model.state_dict(), optim.state_dict(), sched.state_dict(), [rng], 3)
    return path, model, optim, sched, rng


def test_a_checkpoint_round_trips(tmp_path):
    path, model, optim, sched, rng = save(tmp_path)
    expected = torch.rand(5)  # what a trainer resumed from the checkpoint draws next
    state, model_state, optim_state, sched_state, rngs = checkpoint.load(path, "n1")
    assert (state.version, state.step, state.run, state.last_batch) == (2, 2, "n1", "9-1")
    assert state.consumed == ["policy:n1:1", "policy:n1:2"]
    assert all(torch.equal(model_state[k], v) for k, v in model.state_dict().items())
    fresh = trained_model()[1]
    fresh.load_state_dict(optim_state)
    for k, v in optim.state_dict()["state"][0].items():
        assert torch.equal(fresh.state_dict()["state"][0][k], v)
    assert sched_state == sched.state_dict()
    checkpoint.restore_rng(rngs, 0, CPU)
    assert torch.equal(torch.get_rng_state(), rng["torch"])
    assert torch.equal(torch.rand(5), expected)
    written = torch.load(path / "rng.pt", weights_only=True)
    assert torch.equal(written["torch"], rng["torch"])  # rank 0's CPU state where older versions read it


def test_each_rank_gets_its_own_rng_state_back(tmp_path):
    model, optim, sched = trained_model()
    ranks = []
    for seed in (1, 2):  # two ranks whose generators went different ways
        torch.manual_seed(seed)
        ranks.append(checkpoint.rng_state(CPU))
    args = (model.state_dict(), optim.state_dict(), sched.state_dict(), ranks, 3)
    rngs = checkpoint.load(checkpoint.save(tmp_path, TrainerState(version=1, run="n1"), *args), "n1")[4]
    checkpoint.restore_rng(rngs, 1, CPU)
    assert torch.equal(torch.get_rng_state(), ranks[1]["torch"])
    mine = torch.get_rng_state()
    checkpoint.restore_rng(rngs, 2, CPU)  # a rank the checkpoint has none of (resumed on more ranks)
    assert torch.equal(torch.get_rng_state(), mine)


def test_a_checkpoint_from_before_per_rank_rng_states_loads_and_restores_rank_0(tmp_path):
    path, *_ = save(tmp_path)
    torch.manual_seed(7)
    old = torch.get_rng_state()
    torch.save({"torch": old}, path / "rng.pt")  # the file as checkpoints before held it
    expected = torch.rand(3)
    rngs = checkpoint.load(path, "n1")[4]
    checkpoint.restore_rng(rngs, 0, CPU)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_cuda_rng_state_round_trips(tmp_path):
    device = torch.device("cuda", 0)
    torch.cuda.manual_seed(3)
    model, optim, sched = trained_model()
    rng = checkpoint.rng_state(device)
    assert "cuda" in rng
    args = (model.state_dict(), optim.state_dict(), sched.state_dict(), [rng], 3)
    path = checkpoint.save(tmp_path, TrainerState(version=1, run="n1"), *args)
    expected = torch.rand(4, device=device)  # what a trainer resumed from the checkpoint draws next
    torch.rand(100, device=device)
    checkpoint.restore_rng(checkpoint.load(path, "n1")[4], 0, device)
    assert torch.equal(torch.cuda.get_rng_state(device), rng["cuda"])
    assert torch.equal(torch.rand(4, device=device), expected)
    checkpoint.restore_rng([rng], 0, CPU)  # a CUDA checkpoint resumed on the CPU: the CPU state only


class Payload:
    """Unpickling it would create a file: code in a checkpoint, run by whoever loads it."""

    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self):
        return (self.marker.touch, ())


def test_a_pickle_payload_in_the_optimizer_file_is_refused_unrun(tmp_path):
    path = save(tmp_path)[0]
    marker = tmp_path / "payload-ran"
    torch.save({"optimizer": Payload(marker), "scheduler": {}}, path / "optim.pt")
    with pytest.raises(pickle.UnpicklingError):
        checkpoint.load(path, "n1")
    assert not marker.exists()


def test_a_checkpoint_of_another_run_is_refused(tmp_path):
    path = save(tmp_path, run="n1")[0]
    with pytest.raises(ForeignCheckpointError, match="belongs to another run"):
        checkpoint.load(path, "n2")  # a checkpoint directory shared by two runs of one name


def test_a_checkpoint_that_names_no_run_is_refused_unless_adopted(tmp_path):
    """A checkpoint from before run nonces (no nonce, no newest batch id) could be any run's: a run takes
    it only when told to (`adopt`), or once `adopt_into` wrote the run's nonce into it."""
    import json

    path = save(tmp_path, run="n1")[0]
    meta = json.loads((path / "meta.json").read_text())
    del meta["run"], meta["last_batch"]
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ForeignCheckpointError, match="names no run"):
        checkpoint.load(path, "n2")
    state = checkpoint.load(path, "n2", adopt=True)[0]
    assert (state.version, state.run, state.last_batch) == (2, "n2", "0-0")
    checkpoint.adopt_into(path, "n2")
    assert checkpoint.load(path, "n2")[0].run == "n2"
    with pytest.raises(ForeignCheckpointError, match="belongs to another run"):
        checkpoint.load(path, "n3")  # adopted by n2: no longer anyone's


def test_a_batch_uid_handed_out_again_after_redis_lost_writes_is_not_taken_as_trained():
    state = TrainerState(run="n1")
    state.add("policy:n1:7", "1000-0")
    assert state.trained("policy:n1:7", "1000-0")  # redelivered after a crash: trained, skip it
    assert state.trained("policy:n1:7", "999-3")
    # Redis restarted without its last second of writes: the batch counter handed out 7 again, to a new
    # batch with a newer entry id - a batch to train.
    assert not state.trained("policy:n1:7", "1500-0")
    assert not state.trained("policy:n1:8", "900-0")


async def test_the_trainer_refuses_a_checkpoint_directory_of_another_run(bus, tiny_model, tmp_path):
    from astraflow.launch.build import build_trainer
    from astraflow.settings_load import load_settings

    ckpt = tmp_path / "shared-checkpoints"  # trainer.checkpoint_dir outside the run directory
    save(ckpt, run="0123456789ab")  # left there by an earlier run of the same name
    sets = [f"trainer.model={tiny_model}", f"trainer.checkpoint_dir={ckpt}", f"run.dir={tmp_path / 'run'}"]
    service = build_trainer(load_settings(None, sets), bus, "policy")
    with pytest.raises(ForeignCheckpointError, match="belongs to another run"):
        await service.run(asyncio.Event())

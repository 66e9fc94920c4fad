"""`astraflow run` with a `layout` on the CPU, three GPUs emulated (their ids are only handed out): the
trainer runs as two FSDP2 ranks under torchrun (gloo), one RaaS worker beside it, and the run trains,
stops at its target and leaves the workers' logs."""

import pytest

from tests.e2e.test_launcher import run

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]


def test_a_trainer_of_two_ranks_under_torchrun_trains_through_astraflow_run(tmp_path):
    run_dir = tmp_path / "run"
    layout = ["layout.gpus=3", "layout.trainer_gpus=2", "trainer.device=cpu"]
    summary = run(run_dir, "layout", *layout, "run.max_steps=3", "trainer.checkpoint_every=1")
    assert summary["stopped"] == "3 steps" and summary["ledger"]["balanced"], summary
    assert summary["models"]["policy"]["versions"] >= 3
    import torch

    from astraflow.trainer import checkpoint

    saved = checkpoint.latest(run_dir / "checkpoints" / "policy")
    assert len(torch.load(saved / "rng.pt", weights_only=True)["ranks"]) == 2  # both ranks trained

"""`layout:` lays out one node's GPUs: the trainer's FSDP2 ranks under torchrun and one RaaS worker per
engine, each process given its GPUs (CUDA_VISIBLE_DEVICES). Emulated on the CPU: the GPU ids are a
setting, or the launcher's CUDA_VISIBLE_DEVICES with `gpus: auto`; nothing here needs a GPU."""

import json

import pytest

from astraflow.errors import ConfigError
from astraflow.launch.launcher import workers
from astraflow.settings_load import load_settings


def laid_out(*overrides: str):
    s = load_settings(overrides=["engine.type=vllm", *overrides])
    return s, {w.name: w for w in workers(s)}


def section(worker, name: str) -> dict:
    return json.loads(worker.env[f"ASTRAFLOW_{name.upper()}"])


def test_eight_gpus_half_to_trainer_ranks_half_to_one_engine_each():
    s, ws = laid_out("layout.gpus=8")
    assert s.run.raas_workers == 4
    trainer = ws["trainer-policy"]
    assert trainer.module == "torch.distributed.run"
    assert trainer.args == ["--standalone", "--nproc_per_node", "4", "-m", "workers.trainer"]
    assert trainer.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3" == section(trainer, "trainer")["devices"]
    for i in range(4):
        raas = ws[f"raas-{i}"]
        assert raas.module == "workers.raas"
        assert raas.env["CUDA_VISIBLE_DEVICES"] == str(4 + i) == section(raas, "engine")["devices"]
        assert section(raas, "engine")["vllm"]["tensor_parallel_size"] == 1
    assert "CUDA_VISIBLE_DEVICES" not in ws["dataflow"].env


def test_tensor_parallel_engines_and_the_launchers_own_visible_gpus(monkeypatch):
    """`auto` takes the GPUs the launcher may use, by their ids; an engine of two GPUs is tensor parallel."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,5,7,8,9")
    s, ws = laid_out("layout.gpus=auto", "layout.trainer_gpus=2", "layout.engine_gpus=2")
    assert (s.layout.gpus, s.layout.gpu_ids) == (6, ["2", "3", "5", "7", "8", "9"])  # children get these
    assert ws["trainer-policy"].env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert [ws[f"raas-{i}"].env["CUDA_VISIBLE_DEVICES"] for i in range(2)] == ["5,7", "8,9"]
    assert section(ws["raas-0"], "engine")["vllm"]["tensor_parallel_size"] == 2
    # A child sees only its own GPUs, and the count the launcher resolved, not its own view.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    monkeypatch.setenv("ASTRAFLOW_LAYOUT", ws["raas-0"].env["ASTRAFLOW_LAYOUT"])
    assert load_settings(overrides=["engine.type=vllm"]).layout.gpu_ids == s.layout.gpu_ids


def test_one_gpu_is_shared_by_the_trainer_and_one_engine():
    s, ws = laid_out("layout.gpus=1")
    trainer = ws["trainer-policy"]
    assert (trainer.module, trainer.args) == ("workers.trainer", [])  # one process: no torchrun
    assert trainer.env["CUDA_VISIBLE_DEVICES"] == "0" == ws["raas-0"].env["CUDA_VISIBLE_DEVICES"]
    assert s.run.raas_workers == 1


def test_no_layout_leaves_every_process_as_its_section_says():
    s, ws = laid_out("run.raas_workers=2")
    assert s.run.raas_workers == 2 and ws["trainer-policy"].module == "workers.trainer"
    assert all("CUDA_VISIBLE_DEVICES" not in w.env for w in ws.values())


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["layout.gpus=8", "layout.trainer_gpus=8"],
            "--set: layout.trainer_gpus: 8 for the trainer leaves 0",
        ),
        (
            ["layout.gpus=8", "layout.trainer_gpus=5", "layout.engine_gpus=2"],
            "--set: layout.engine_gpus: the 3",
        ),
        (["layout.gpus=1", "layout.engine_gpus=2"], "--set: layout: one GPU: the trainer and one engine"),
        (["layout.gpus=4", "layout.gpu_ids=[0,1]"], "--set: layout.gpu_ids: names 2 GPUs, layout.gpus 4"),
        (
            ["layout.gpus=4", "layout.engine_gpus=2", "engine.type=hf"],
            "--set: layout.engine_gpus: the hf engine",
        ),
    ],
)
def test_a_layout_that_does_not_fit_is_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_settings(overrides=overrides)
    header, *problems = str(err.value).splitlines()
    assert header == "invalid settings:" and len(problems) == 1 and message in problems[0], str(err.value)


def test_auto_without_a_visible_gpu_is_refused(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ConfigError, match=r"layout.gpus: is auto but no GPU is visible"):
        load_settings(overrides=["layout.gpus=auto"])


def test_auto_counts_the_drivers_gpus_when_nothing_narrows_them(monkeypatch, tmp_path):
    from astraflow import layout

    for pci in ("0000:17:00.0", "0000:65:00.0"):
        (tmp_path / pci).mkdir()
    monkeypatch.setattr(layout, "NVIDIA_GPUS", tmp_path)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    s, ws = laid_out("layout.gpus=auto")
    assert (s.layout.gpus, s.layout.gpu_ids) == (2, ["0", "1"])
    assert (ws["trainer-policy"].env["CUDA_VISIBLE_DEVICES"], ws["raas-0"].env["CUDA_VISIBLE_DEVICES"]) == (
        "0",
        "1",
    )

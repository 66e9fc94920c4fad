"""The local files settings name - starting weights and datasets - are checked when the settings load,
relative paths and hub ids too, with the field named; a model the run builds itself is not refused."""

from pathlib import Path

import pytest

from astraflow.cli import main
from astraflow.errors import ConfigError
from astraflow.settings_load import load_settings

GSM8K = Path(__file__).parents[2] / "recipes" / "gsm8k-qwen.yaml"


def test_a_recipe_naming_missing_weights_and_data_is_refused_field_by_field(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["config", str(GSM8K)]) == 1
    err = capsys.readouterr().err
    assert "gsm8k-qwen.yaml: engine.model: starting weights: no such directory" in err, err
    assert "Traceback" not in err
    (tmp_path / "models" / "Qwen2.5-1.5B-Instruct").mkdir(parents=True)
    assert main(["config", str(GSM8K)]) == 1
    assert "gsm8k-qwen.yaml: dataflow.dataset.path: no such file" in capsys.readouterr().err
    (tmp_path / "data" / "gsm8k").mkdir(parents=True)
    (tmp_path / "data" / "gsm8k" / "train.jsonl").write_text('{"question": "1+1?"}\n')
    assert main(["config", str(GSM8K)]) == 0


def test_relative_model_paths_are_checked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"--set: engine\.model: starting weights: no such directory"):
        load_settings(overrides=["engine.model=models/nope"])
    with pytest.raises(ConfigError, match=r"--set: trainer\.model: starting weights: no such directory"):
        load_settings(overrides=["trainer.model=nope"])
    (tmp_path / "models" / "here").mkdir(parents=True)
    assert (
        load_settings(overrides=["engine.model=models/here"]).policy("policy").trainer.model == "models/here"
    )


def test_a_hub_model_must_be_in_the_local_cache(tmp_path, monkeypatch):
    """Looked up offline: a model absent from the cache fails at once instead of the engine retrying the
    hub (for over a minute without a network), then failing."""
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ConfigError, match=r"engine\.model: .*nor a model of that name in the Hugging Face cache"
    ):
        load_settings(overrides=["engine.model=acme/tiny-chat"])
    repo = cache / "models--acme--tiny-chat"  # what `hf download acme/tiny-chat` leaves
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abc")
    (repo / "snapshots" / "0123abc").mkdir(parents=True)
    (repo / "snapshots" / "0123abc" / "config.json").write_text("{}")
    assert load_settings(overrides=["engine.model=acme/tiny-chat"]).policy("policy").engine.model


def test_the_runs_own_tiny_model_and_a_served_name_are_not_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the tiny model's cache is empty here: the run builds it
    assert load_settings(overrides=["run.tiny={}"]).policy("policy").engine.model
    judge = "{policy: {}, judge: {train: false, model: judge-7b, engine: {type: openai, base_url: 'http://j/v1'}}}"
    assert load_settings(overrides=["run.tiny={}", f"run.models={judge}"]).policy("judge").engine.model


def test_dataset_paths_are_checked_with_the_field_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"--set: dataflow\.dataset\.path: no such file \(relative to"):
        load_settings(overrides=["dataflow.dataset={type: jsonl, path: data/train.jsonl}"])
    evals = "eval.datasets=[{name: held, dataset: {type: hf_disk, path: " + str(tmp_path / "nope") + "}}]"
    with pytest.raises(ConfigError, match=r"eval\.datasets\.0\.dataset\.path: no such directory$"):
        load_settings(overrides=[evals])
    (tmp_path / "nope").mkdir()
    assert load_settings(overrides=[evals]).eval.datasets[0].name == "held"

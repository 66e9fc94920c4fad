"""Per-policy settings: run.models as a mapping, shared sections as defaults, rules across sections."""

import pytest
import yaml

from astraflow.cli import main
from astraflow.errors import ConfigError
from astraflow.settings_load import load_settings, to_env


def recipe(tmp_path, data: dict):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_two_policies_from_different_dirs_get_their_own_engine_and_trainer(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    models = {
        "actor": {"model": str(tmp_path / "a"), "engine": {"devices": "0"}, "trainer": {"lr": 1e-5}},
        "critic": {"model": str(tmp_path / "b"), "trainer": {"loss": {"clip_high": 0.3}, "devices": "1,2"}},
    }
    shared = {
        "engine": {"type": "hf", "max_model_len": 256},
        "trainer": {"lr": 3e-4, "loss": {"kl_coef": 0.1}},
    }
    s = load_settings(recipe(tmp_path, {"run": {"models": models}, **shared}))
    actor, critic = s.policy("actor"), s.policy("critic")
    assert (actor.engine.model, critic.engine.model) == (str(tmp_path / "a"), str(tmp_path / "b"))
    assert (actor.trainer.model, critic.trainer.model) == (str(tmp_path / "a"), str(tmp_path / "b"))
    assert (actor.engine.devices, critic.engine.devices) == ("0", "")
    assert (actor.trainer.devices, critic.trainer.devices) == ("", "1,2")
    assert (actor.trainer.lr, critic.trainer.lr) == (1e-5, 3e-4)
    # a deep merge: the policy's clip_high beside the shared kl_coef and the defaults
    assert (critic.trainer.loss.clip_high, critic.trainer.loss.kl_coef, critic.trainer.loss.clip_low) == (
        0.3,
        0.1,
        0.2,
    )
    assert actor.engine.max_model_len == critic.engine.max_model_len == 256
    assert s.trained == ["actor", "critic"]


def test_a_judge_served_by_openai_is_not_trained(tmp_path):
    models = {
        "policy": {},
        "judge": {
            "train": False,
            "model": "judge-7b",
            "engine": {"type": "openai", "base_url": "http://j/v1"},
        },
    }
    s = load_settings(recipe(tmp_path, {"run": {"models": models, "tiny": {}}}))
    assert s.trained == ["policy"]
    judge = s.policy("judge")
    assert (judge.train, judge.engine.type, judge.engine.model) == (False, "openai", "judge-7b")
    assert s.policy("policy").engine.model == str(s.run.tiny.path)
    assert s.policy("policy").engine.type == "auto"


def test_the_list_form_still_loads():
    s = load_settings(overrides=["run.models=[solver, verifier]"])
    assert list(s.run.models) == s.trained == ["solver", "verifier"]
    assert s.policy("verifier").engine == s.engine


def test_sync_mode_is_lockstep_in_every_process(tmp_path, monkeypatch):
    """Not a fix-up of the launcher: a worker started alone sees staleness 0 as well."""
    path = recipe(tmp_path, {"dataflow": {"max_staleness_steps": 3}})
    assert load_settings(path).dataflow.max_staleness_steps == 3
    assert load_settings(path, ["trainer.mode=sync"]).dataflow.max_staleness_steps == 0
    monkeypatch.setenv("ASTRAFLOW_TRAINER__MODE", "sync")
    assert load_settings(path).dataflow.max_staleness_steps == 0


def test_a_policy_cannot_set_the_run_wide_mode(tmp_path):
    path = recipe(tmp_path, {"run": {"models": {"p": {"trainer": {"mode": "sync"}}}}})
    with pytest.raises(
        ConfigError, match=rf"{path}: run\.models\.p\.trainer\.mode: trainer\.mode is run-wide"
    ):
        load_settings(path)


def test_a_bad_policy_field_names_the_field_and_source():
    with pytest.raises(
        ConfigError, match=r"--set: run\.models\.p\.engine\.max_batch: Input should be greater"
    ):
        load_settings(overrides=["run.models={p: {engine: {max_batch: 0}}}"])


def test_a_workflow_model_must_be_a_policy(tmp_path):
    path = recipe(
        tmp_path,
        {"run": {"models": ["solver", "verifier"]}, "dataflow": {"feeder": {"workflow": "solve_and_verify"}}},
    )
    assert load_settings(path, ["raas.workflow_options.verifier_model=solver"]).run.models
    with pytest.raises(ConfigError, match=r"--set: raas\.workflow_options\.verifier_model: names no policy"):
        load_settings(path, ["raas.workflow_options.verifier_model=judge"])
    with pytest.raises(ConfigError, match=r"--set: run\.models: solve_and_verify needs two policies"):
        load_settings(path, ["run.models=[solver]"])
    with pytest.raises(ConfigError, match=r"run\.models: route needs two policies: a small one and a large"):
        load_settings(path, ["run.models=[solver]", "dataflow.feeder.workflow=route"])


def test_a_trained_policy_whose_sampling_the_trainer_cannot_reproduce_is_refused_in_one_line():
    """Every loss weighs the trainer's logprobs against the engine's: a vLLM logits processor, the model's
    generation defaults or raw logprobs would make them of another distribution (say with a correction,
    a weight of 1 at the same weights would no longer be 1). A frozen judge may use them."""
    flags = '["--logits-processors", "my.module:Proc"]'
    with pytest.raises(ConfigError, match=r"--set: engine: a trained policy's tokens must be scored as") as e:
        load_settings(overrides=[f"engine.vllm.extra_args={flags}"])
    assert "--logits-processors" in str(e.value) and str(e.value).count("\n") == 1  # one problem line
    with pytest.raises(ConfigError, match=r"run\.models\.p\.engine: .*--generation-config"):
        load_settings(overrides=['run.models={p: {engine: {vllm: {extra_args: ["--generation-config=x"]}}}}'])
    judge = '{p: {}, j: {train: false, engine: {vllm: {extra_args: ["--logprobs-mode", "raw_logprobs"]}}}}'
    assert load_settings(overrides=[f"run.models={judge}"]).policy("j").train is False


def test_starting_weights_must_exist(tmp_path, monkeypatch):
    missing = tmp_path / "nowhere"
    with pytest.raises(
        ConfigError, match=r"--set: run\.models\.p\.model: starting weights: no such directory"
    ):
        load_settings(overrides=[f"run.models={{p: {{model: {missing}}}}}"])
    monkeypatch.setenv("ASTRAFLOW_TRAINER__MODEL", str(missing))
    with pytest.raises(ConfigError, match=r"env ASTRAFLOW_TRAINER__MODEL: trainer\.model: starting weights"):
        load_settings()
    monkeypatch.delenv("ASTRAFLOW_TRAINER__MODEL")
    (tmp_path / "weights").mkdir()
    monkeypatch.chdir(tmp_path)  # a relative directory (hub ids: test_local_files)
    assert load_settings(overrides=["engine.model=weights"]).policy("policy").trainer.model == "weights"
    assert load_settings(overrides=["run.tiny={}"]).policy("policy").engine.model  # run.tiny builds it


def test_a_run_needs_a_trained_policy():
    with pytest.raises(ConfigError, match=r"--set: run\.models: no policy is trained"):
        load_settings(overrides=["run.models={j: {train: false}}"])


def test_config_prints_each_policys_effective_settings(capsys):
    args = [
        "config",
        "--set",
        "run.models={a: {engine: {max_batch: 7}}, b: {}}",
        "--set",
        "engine.max_batch=9",
    ]
    assert main(args) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["policies"]["a"]["engine"]["max_batch"] == 7
    assert printed["policies"]["b"]["engine"]["max_batch"] == 9


def test_a_child_process_sees_the_same_policies(tmp_path, monkeypatch):
    """The launcher hands its workers their settings through the environment (`to_env`)."""
    models = {"actor": {"trainer": {"lr": 1e-5}}, "judge": {"train": False, "engine": {"type": "openai"}}}
    parent = load_settings(recipe(tmp_path, {"run": {"models": models}, "trainer": {"mode": "sync"}}))
    for name, value in to_env(parent).items():
        monkeypatch.setenv(name, value)
    child = load_settings()
    assert child.trained == ["actor"]
    assert child.policy("actor") == parent.policy("actor") and child.policy("judge") == parent.policy("judge")
    assert child.dataflow.max_staleness_steps == 0


def test_an_openai_judge_speaks_token_ids_of_the_tokenizer_it_names(tmp_path, tiny_model):
    """Workflows send every engine token ids: an `openai` endpoint's model is a name, so the RaaS needs its
    tokenizer's directory (`engine.tokenizer`), and says so before it starts anything without one."""
    from astraflow.launch.build import load_tokenizers

    judge = {"train": False, "model": "judge-7b", "engine": {"type": "openai", "base_url": "http://j/v1"}}
    models = {"policy": {"model": tiny_model}, "judge": judge}
    s = load_settings(recipe(tmp_path, {"run": {"models": models}}))
    with pytest.raises(ConfigError, match=r"run.models.judge.engine.tokenizer"):
        load_tokenizers([s.policy(m) for m in s.run.models])
    judge["engine"]["tokenizer"] = tiny_model
    s = load_settings(recipe(tmp_path, {"run": {"models": models}}))
    tokenizers = load_tokenizers([s.policy(m) for m in s.run.models])
    assert tokenizers["judge"].encode("12") == tokenizers["policy"].encode("12")

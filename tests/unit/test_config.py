"""Settings: recipes load, precedence recipe < env < --set, errors name field and source, secrets hidden."""

from pathlib import Path

import pytest
import yaml

from astraflow.cli import main
from astraflow.config import redact_url
from astraflow.errors import ConfigError
from astraflow.settings_load import load_settings

RECIPES = sorted(Path(__file__).parents[2].joinpath("recipes").glob("*.yaml"))


def test_there_are_recipes():
    assert RECIPES


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_recipe_loads(recipe, tmp_path, monkeypatch):
    """Given the local files it names (a real model's weights and data, which its user provides: settings
    that name missing ones are refused), from the working directory they are relative to."""
    monkeypatch.chdir(tmp_path)
    data = yaml.safe_load(recipe.read_text())
    if model := data.get("engine", {}).get("model"):
        (tmp_path / model).mkdir(parents=True)
    if dataset := data.get("dataflow", {}).get("dataset", {}).get("path"):
        (tmp_path / dataset).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / dataset).touch()
    assert load_settings(recipe).run.name


def test_wrong_field_in_recipe_names_field_and_file(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("streams:\n  lease_mss: 100\nraas:\n  slots: -1\n")
    with pytest.raises(ConfigError) as err:
        load_settings(recipe)
    assert f"{recipe}: streams.lease_mss: Extra inputs are not permitted" in str(err.value)
    assert f"{recipe}: raas.slots: Input should be greater than or equal to 1" in str(err.value)


def test_unreadable_recipe_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"missing\.yaml: cannot read recipe"):
        load_settings(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- a\n")
    with pytest.raises(ConfigError, match=r"list\.yaml: a recipe is a mapping"):
        load_settings(tmp_path / "list.yaml")


def test_precedence_recipe_then_env_then_set(tmp_path, monkeypatch):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("streams:\n  lease_ms: 100\n  block_ms: 50\nraas:\n  slots: 2\n")
    monkeypatch.setenv("ASTRAFLOW_STREAMS__LEASE_MS", "200")
    monkeypatch.setenv("ASTRAFLOW_RAAS__SLOTS", "3")
    s = load_settings(recipe, ["raas.slots=4"])
    assert (s.streams.lease_ms, s.streams.block_ms, s.raas.slots) == (200, 50, 4)
    assert s.streams.max_deliveries == 3  # untouched default next to overridden fields


def test_bad_env_and_set_values_name_their_source(monkeypatch):
    monkeypatch.setenv("ASTRAFLOW_RAAS__SLOTS", "many")
    with pytest.raises(ConfigError, match=r"env ASTRAFLOW_RAAS__SLOTS: raas\.slots"):
        load_settings()
    monkeypatch.delenv("ASTRAFLOW_RAAS__SLOTS")
    with pytest.raises(ConfigError, match=r"--set: engine\.type: Input should be"):
        load_settings(overrides=["engine.type=tpu"])
    with pytest.raises(ConfigError, match=r"expected section\.key=value"):
        load_settings(overrides=["engine.type"])


def test_secrets_are_never_printed(capsys, monkeypatch):
    monkeypatch.setenv("ASTRAFLOW_WEIGHTS__SECRET", "weights-s3cret")
    args = ["config", "--set", "redis.password=hunter2", "--redis", "redis://:pa55word@db:6379/0"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "hunter2" not in out and "pa55word" not in out and "weights-s3cret" not in out
    assert "redis://:***@db:6379/0" in out
    settings = load_settings(overrides=["redis.password=hunter2"])
    assert "hunter2" not in repr(settings) and "hunter2" not in str(settings)


def test_secret_in_an_error_is_not_echoed():
    with pytest.raises(ConfigError) as err:
        load_settings(overrides=["redis.password=[1, 2]", "weights.secret={a: topsecret}"])
    assert "topsecret" not in str(err.value)


def test_redact_url():
    assert redact_url("redis://user:pw@host:1/0") == "redis://user:***@host:1/0"
    assert redact_url("redis://host:1/0") == "redis://host:1/0"
    assert redact_url("redis://host:1/0?password=pw&db=2") == "redis://host:1/0?password=***&db=2"


def test_a_run_name_that_would_match_other_runs_keys_is_refused():
    """The name goes into SCAN and ACL key patterns: `a*` would clear or open run `ab` too."""
    for name in ("a*", "a?", "a[b]", "a:b", ""):
        with pytest.raises(ConfigError, match=r"run\.name"):
            load_settings(overrides=[f"run.name={name}"])
    assert load_settings(overrides=["run.name=exp-1.v2_b"]).run.name == "exp-1.v2_b"


def test_a_resumed_run_gets_every_secret_back_not_its_mask(tmp_path):
    """`settings.yaml` (what `--resume` loads) keeps each secret itself: a masked one would come back as
    the public string `**********` (a push key anyone knows, an API key that fails)."""
    from astraflow.launch.launcher import _save_settings

    secrets = {
        "raas.push_key": "push-k",
        "raas.accept_pushed_code": "true",
        "engine.api_key": "api-k",
        "redis.password": "redis-pw",
        "weights.secret": "weights-s",
    }
    settings = load_settings(None, [f"{k}={v}" for k, v in secrets.items()])
    _save_settings(settings, tmp_path / "settings.yaml")
    assert "*****" not in (tmp_path / "settings.yaml").read_text()
    resumed = load_settings(str(tmp_path / "settings.yaml"))
    for key, value in secrets.items():
        section, field = key.split(".")
        got = getattr(getattr(resumed, section), field)
        assert (got.get_secret_value() if hasattr(got, "get_secret_value") else str(got).lower()) == value
    assert resumed.model_dump() == settings.model_dump()


def test_no_command_line_in_the_docs_carries_a_redis_password():
    """`ps` shows a process's arguments to every user: the README and docs pass credentials in files or
    the environment, never as `--redis`/`--set redis.*url` arguments."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    argument = re.compile(r"(--redis\s+|--set\s+redis\.\w*url=)rediss?://[^\s@/]*@")
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            assert not argument.search(line), f"{doc.name}:{n}: {line}"


def test_config_masks_the_replica_password(monkeypatch):
    monkeypatch.setenv("ASTRAFLOW_REDIS__REPLICA_URL", "redis://:pw@replica:6379/0")
    assert load_settings().redacted()["redis"]["replica_url"] == "redis://:***@replica:6379/0"


def test_the_agent_workflow_needs_the_endpoint():
    with pytest.raises(ConfigError, match=r"raas\.openai_api: workflow agent runs programs"):
        load_settings(None, ["dataflow.feeder.workflow=agent"])
    assert load_settings(None, ["dataflow.feeder.workflow=agent", "raas.openai_api=true"]).raas.openai_api

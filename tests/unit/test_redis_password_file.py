"""`redis.password_file`: a password read from a file at start (a mounted Secret that only one process
sees), exclusive with `redis.password`, refused clearly when unreadable, never printed."""

import pytest

from astraflow.cli import main
from astraflow.errors import ConfigError
from astraflow.settings_load import load_settings, to_env
from astraflow.streams.connection import credentials, make_client


@pytest.fixture
def password_file(tmp_path, monkeypatch):
    """A password file named by the environment, as a pod's env names its mounted Secret."""
    path = tmp_path / "redis-password"
    monkeypatch.setenv("ASTRAFLOW_REDIS__USERNAME", "af-run-raas-raas-0")
    monkeypatch.setenv("ASTRAFLOW_REDIS__PASSWORD_FILE", str(path))
    return path


@pytest.mark.parametrize(
    ("content", "password"), [("s3cret\n", "s3cret"), ("s3cret", "s3cret"), ("a b\n\n", "a b\n")]
)
def test_the_files_content_less_one_newline_is_what_clients_authenticate_with(
    password_file, content, password
):
    password_file.write_text(content)
    redis = load_settings().redis
    assert credentials(redis) == {"username": "af-run-raas-raas-0", "password": password}
    client = make_client("redis://127.0.0.1:1/0", redis)
    assert client.connection_pool.connection_kwargs["password"] == password


def test_a_child_process_reads_the_file_again_and_never_gets_both(password_file, monkeypatch):
    """`astraflow run` hands its workers the settings as env vars (`to_env`): the file's name travels,
    not its content, so the child reads it itself and is not refused for giving both."""
    password_file.write_text("s3cret\n")
    env = to_env(load_settings())
    assert "s3cret" not in str(env)
    monkeypatch.delenv("ASTRAFLOW_REDIS__PASSWORD_FILE")
    monkeypatch.delenv("ASTRAFLOW_REDIS__USERNAME")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert credentials(load_settings().redis)["password"] == "s3cret"


def test_password_and_password_file_together_are_refused_naming_both(password_file):
    password_file.write_text("from-the-file\n")
    with pytest.raises(ConfigError) as err:
        load_settings(overrides=["redis.password=hunter2"])
    message = str(err.value)
    assert "env ASTRAFLOW_REDIS__PASSWORD_FILE: redis.password_file:" in message
    assert "redis.password and redis.password_file are both set" in message
    assert "hunter2" not in message and "from-the-file" not in message


@pytest.mark.parametrize("make", ["missing", "directory", "empty"])
def test_an_unreadable_or_empty_password_file_is_refused_naming_it(password_file, make):
    """A directory is what a `subPath` mount of a Secret key that does not exist leaves."""
    if make == "directory":
        password_file.mkdir()
    elif make == "empty":
        password_file.write_text("\n")
    with pytest.raises(ConfigError, match=r"redis\.password_file: .*redis-password"):
        load_settings()


def test_the_files_content_is_never_printed(password_file, capsys):
    password_file.write_text("s3cret\n")
    assert main(["config"]) == 0
    out = capsys.readouterr().out
    assert "s3cret" not in out and str(password_file) in out
    settings = load_settings()
    assert "s3cret" not in repr(settings) and "s3cret" not in str(settings.redacted())

import socket
import subprocess
import sys

import pytest

from astraflow.cli import main

HELP_PROBE = """
import sys
from astraflow.cli import main
try:
    main(["--help"])
except SystemExit:
    pass
print([m for m in ("torch", "transformers", "vllm", "numpy", "redis", "pydantic") if m in sys.modules])
"""


def test_help_imports_nothing_heavy():
    probe = subprocess.run([sys.executable, "-c", HELP_PROBE], capture_output=True, text=True, check=True)
    out = probe.stdout
    assert "usage: astraflow" in out
    assert out.strip().endswith("[]")


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "inspect" in capsys.readouterr().out


def test_config_error_is_one_clear_line(capsys):
    assert main(["config", "--set", "streams.lease_ms=soon"]) == 1
    err = capsys.readouterr().err
    assert "--set: streams.lease_ms: Input should be a valid integer" in err
    assert "Traceback" not in err


def test_redis_url_with_credentials_on_the_command_line_is_warned_about_and_a_file_is_not(capsys, tmp_path):
    assert main(["config", "--redis", "redis://:hunter2@redis-host:6379/0"]) == 0
    out, err = capsys.readouterr()
    assert "--redis-file" in err and "hunter2" not in out + err
    (tmp_path / "url").write_text("redis://:hunter2@redis-host:6379/0\n")
    assert main(["config", "--redis-file", str(tmp_path / "url")]) == 0
    out, err = capsys.readouterr()
    assert err == "" and "redis://:***@redis-host:6379/0" in out and "hunter2" not in out


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("command", [["ledger"], ["inspect"], ["trace", "u1"]], ids=str)
def test_an_unreachable_redis_is_one_line_naming_it(capsys, command):
    port = closed_port()
    assert main([*command, "--run", "r", "--redis", f"redis://127.0.0.1:{port}/0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"astraflow: Redis unreachable: Error 111 connecting to 127.0.0.1:{port}."), err
    assert err.count("\n") == 1 and "--redis" in err


def test_a_missing_redis_file_is_one_line_and_debug_shows_the_traceback(capsys, tmp_path):
    missing = tmp_path / "nowhere"
    assert main(["ledger", "--redis-file", str(missing)]) == 1
    err = capsys.readouterr().err
    assert err == f"astraflow: --redis-file {missing}: cannot read it (No such file or directory)\n"
    assert main(["ledger", "--redis-file", str(missing), "--debug"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):") and err.endswith(
        f"astraflow: --redis-file {missing}: cannot read it (No such file or directory)\n"
    )


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == "astraflow 0.1.0"


def test_a_shipped_recipe_is_found_by_name_outside_the_repository(tmp_path):
    """`astraflow run addition-tiny` from any directory: the recipes are installed with the package."""
    for name in ("addition-tiny", "recipes/addition-tiny.yaml"):
        cmd = [sys.executable, "-m", "astraflow.cli", "config", name]
        done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert "name: addition" in done.stdout


def test_every_command_takes_the_recipe_first(capsys):
    """`trace` and `workflow` took `--recipe` where the others take it positionally (still accepted)."""
    from astraflow.cli import _parser

    trace = _parser().parse_args(["trace", "addition-tiny", "e0r1"])
    assert (trace.recipe, trace.uid) == ("addition-tiny", "e0r1")
    assert _parser().parse_args(["trace", "e0r1"]).recipe is None
    push = _parser().parse_args(["workflow", "addition-tiny", "push", "m:C"])
    assert (push.recipe, push.action, push.ref) == ("addition-tiny", "push", "m:C")
    assert main(["trace", "--recipe", "nope-recipe", "e0r1"]) == 1
    err = capsys.readouterr().err
    assert "--recipe is deprecated" in err and "nope-recipe: cannot read recipe" in err

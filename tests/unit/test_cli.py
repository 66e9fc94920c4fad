import subprocess
import sys

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

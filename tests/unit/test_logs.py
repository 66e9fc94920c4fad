"""Logs are JSON lines whenever stderr is not a terminal, from the first event a command logs (before
a worker configured its own), at the level `log.level` sets."""

import json
import subprocess
import sys

import pytest
import structlog

from astraflow import logs
from astraflow.errors import ConfigError
from astraflow.settings_load import load_settings


def test_json_lines_off_a_tty_with_worker_and_run_bound(capsys):
    logs.configure(worker="raas-1", run="demo")
    try:
        structlog.get_logger("t").info("batch_published", model="policy", size=8)
    finally:
        structlog.reset_defaults()
        structlog.contextvars.clear_contextvars()
    line = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert line["event"] == "batch_published" and line["size"] == 8
    assert (line["worker"], line["run"], line["level"]) == ("raas-1", "demo", "info")


EARLY = """
import structlog
from astraflow import logs
from astraflow.cli import main
main(["config", "--set", "log.level=warning"])
structlog.get_logger().info("before_start", a=1)
logs.configure("warning")
structlog.get_logger().info("hidden")
structlog.get_logger().warning("shown", b=2)
"""


def test_events_are_json_off_a_terminal_from_the_first_one_and_filtered_by_level():
    done = subprocess.run([sys.executable, "-c", EARLY], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    events = [json.loads(line) for line in done.stderr.splitlines()]
    assert [(e["event"], e["level"]) for e in events] == [("before_start", "info"), ("shown", "warning")]
    assert "level: warning" in done.stdout  # the setting, as `astraflow config` shows it


def test_log_level_is_a_checked_setting():
    assert load_settings(overrides=["log.level=debug"]).log.level == "debug"
    with pytest.raises(ConfigError, match=r"log\.level"):
        load_settings(overrides=["log.level=loud"])

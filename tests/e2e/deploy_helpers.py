"""What the deploy tests share: where deploy/ is, running `astraflow` as a container would, waiting."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import redis
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
ASTRAFLOW = [sys.executable, "-m", "astraflow.cli"]


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def wait_for(cond, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := cond():
            return value
        time.sleep(0.5)
    raise TimeoutError(what)


def astraflow_args(command: list[str]) -> list[str]:
    """A container's `astraflow ...` command as this machine runs it."""
    assert command[0] == "astraflow", command
    return [*ASTRAFLOW, *command[1:]]


def effective_settings(recipe: str, env: dict[str, str]) -> dict:
    """What `astraflow config` prints for `recipe` under `env` (it exits 0: the settings are valid)."""
    cmd = [*ASTRAFLOW, "config", recipe]
    out = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


def redis_up(port: str, password: str | None = None) -> bool:
    try:
        return redis.Redis(port=int(port), password=password).ping()
    except redis.ConnectionError:
        return False


def events(log: Path, name: str) -> list[dict]:
    """The JSON log lines of one event in a worker's log."""
    found = []
    for line in log.read_text().splitlines():
        if line.startswith("{") and f'"{name}"' in line:
            event = json.loads(line)
            if event.get("event") == name:
                found.append(event)
    return found

"""A Redis URL with a password never shows in `ps`: `astraflow run` takes it from a file (`--redis-file`)
or the environment (`ASTRAFLOW_REDIS__URL`), and the processes it starts get their settings through the
environment, so no /proc/<pid>/cmdline of the run carries the password."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from astraflow.launch import launcher
from astraflow.settings_load import load_settings

pytestmark = pytest.mark.integration


def descendants(root: int) -> dict[int, bytes]:
    """pid -> command line of `root` and every process below it (children start sessions of their own,
    but keep their parent)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    tree, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        kids = [p for p, parent in parents.items() if parent == pid and p not in tree]
        tree.update(kids)
        frontier += kids
    lines = {}
    for pid in tree:
        try:
            lines[pid] = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
    return lines


@pytest.mark.parametrize("via", ["file", "env"])
def test_no_process_of_a_run_has_the_redis_password_on_its_command_line(redis_url, tmp_path, via):
    password = urlsplit(redis_url).password
    assert password
    cmd = [sys.executable, "-m", "astraflow.cli", "run", "recipes/bus-demo.yaml", "--run", "ps"]
    cmd += [
        "--set",
        f"run.dir={tmp_path / 'run'}",
        "--set",
        "demo.groups=240",
        "--set",
        "demo.kill_one=false",
    ]
    env = dict(os.environ)
    if via == "file":
        (tmp_path / "redis-url").write_text(redis_url + "\n")
        cmd += ["--redis-file", str(tmp_path / "redis-url")]
    else:
        env["ASTRAFLOW_REDIS__URL"] = redis_url
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    seen: set[tuple[int, bytes]] = set()
    try:
        while proc.poll() is None:
            seen.update(descendants(proc.pid).items())
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
        out = proc.communicate()[0].decode(errors="replace")
    assert proc.returncode == 0, out[-3000:]
    workers = {pid for pid, line in seen if b"workers.demo" in line}
    assert len(workers) == 3  # the demo's RaaS processes were seen running
    assert not [line for _, line in seen if password.encode() in line]
    assert password not in out


def test_the_launcher_hands_workers_their_settings_in_the_environment(tmp_path):
    url = "redis://:s3cret-pw@127.0.0.1:1/0"
    settings = load_settings(None, [f"redis.url={url}", f"run.dir={tmp_path}", "run.models=[a, b]"])
    workers = launcher.workers(settings)
    assert len(workers) == 4  # dataflow, one RaaS, a trainer per model
    for w in workers:
        assert not any("s3cret-pw" in a for a in [w.module, *w.args])
        assert "s3cret-pw" in w.env["ASTRAFLOW_REDIS"]

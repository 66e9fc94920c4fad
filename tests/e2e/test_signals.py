"""`kill -TERM` / `kill -HUP` of `astraflow run` (what systemd, Kubernetes and Slurm send; a closed
terminal): every process of the run ends - the embedded Redis, the dataflow, the RaaS, the trainer and
whatever they started - the report is written, and the exit status is the signal's."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from astraflow.redis_server import STATE_FILE
from tests.e2e.test_chaos import start_run, steps_done, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]


def descendants(root: int) -> set[int]:
    """Pids of every live process below `root` in the process tree (children, grandchildren, ...)."""
    parents = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                stat = Path(f"/proc/{name}/stat").read_text()
            except OSError:
                continue
            parents[int(name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    """Running (a zombie waiting for whoever adopted it to reap it counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize(("sig", "name"), [(signal.SIGTERM, "SIGTERM"), (signal.SIGHUP, "SIGHUP")])
def test_sigterm_stops_every_process_of_the_run_and_writes_the_report(tmp_path, sig, name):
    run_dir = tmp_path / "run"
    launcher = start_run(run_dir, "term")
    try:
        wait_for(lambda: steps_done(run_dir) >= 3, 240, "the first steps")
        run = descendants(launcher.pid)
        workers = set(json.loads((run_dir / "pids.json").read_text()).values())
        assert workers <= run and len(run) > len(workers)  # the embedded Redis is one of them too
        launcher.send_signal(sig)
        out, _ = launcher.communicate(timeout=180)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 128 + sig, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    for pid in run:
        wait_for(lambda p=pid: not alive(p), 15, f"process {pid} of the run gone")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped"] == f"interrupted ({name})" and summary["ledger"]["balanced"], summary
    assert (run_dir / "reward.png").exists()


def test_sigterm_stops_the_bus_demo_and_its_embedded_redis(tmp_path):
    cmd = [sys.executable, "-m", "astraflow.cli", "run", "recipes/bus-demo.yaml", "--run", "term-demo"]
    for s in (f"run.dir={tmp_path}", "demo.groups=100000", "demo.workers=2", "demo.kill_one=false"):
        cmd += ["--set", s]
    demo = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        while "collected" not in demo.stdout.readline():  # its workers are rolling out
            assert demo.poll() is None
        run = descendants(demo.pid)
        assert len(run) >= 3  # the embedded Redis and the two workers
        demo.send_signal(signal.SIGTERM)
        out, _ = demo.communicate(timeout=120)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    assert demo.returncode == 128 + signal.SIGTERM, out[-3000:]
    for pid in run:
        wait_for(lambda p=pid: not alive(p), 15, f"process {pid} of the demo gone")


def test_kill_9_of_the_launcher_ends_the_run_and_resume_goes_on(tmp_path):
    """`kill -9` of `astraflow run` (an OOM kill, a lost node): its workers and its embedded Redis end
    with it (SIGTERM on parent death), so nothing of the run lingers, and `--resume` goes on from what
    Redis (its AOF) and the checkpoints hold."""
    run_dir = tmp_path / "run"
    launcher = start_run(run_dir, "kill9")
    try:
        wait_for(lambda: steps_done(run_dir) >= 3, 240, "the first steps")
        run = descendants(launcher.pid)
        redis = json.loads((run_dir / "redis" / STATE_FILE).read_text())["pid"]
        assert redis in run and set(json.loads((run_dir / "pids.json").read_text()).values()) <= run
        launcher.kill()
        launcher.communicate(timeout=30)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    for pid in run:
        wait_for(lambda p=pid: not alive(p), 30, f"process {pid} of the run gone")  # not its grace

    steps = steps_done(run_dir)
    cmd = [sys.executable, "-m", "astraflow.cli", "run", "--resume", str(run_dir)]
    result = subprocess.run(
        [*cmd, "--set", f"run.max_steps={steps + 6}"], capture_output=True, text=True, timeout=400
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped"] == f"{steps + 6} steps" and summary["ledger"]["balanced"], summary

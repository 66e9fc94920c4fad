"""`kill -9` of a RaaS, the dataflow and the trainer during `astraflow run` (each once, pids from the
run's pids.json, children of the launcher this test started): the run completes, the ledger balances, no
group is in two trained batches, the trainer's versions have no gap, and notices go back only to a
checkpoint (the restarted trainer's rollback). Ctrl-C (twice) stops
every process and still leaves the report."""

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from astraflow import redis_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]
STEPS = 60


def wait_for(cond, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.2)
    raise TimeoutError(what)


def steps_done(run_dir) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_run_survives_kill_9_of_each_worker_kind(tmp_path):
    run_dir = tmp_path / "run"
    sets = [
        f"run.dir={run_dir}",
        "engine.type=hf",
        "run.target_reward=null",
        f"run.max_steps={STEPS}",
        "streams.lease_ms=3000",
        "streams.trim_interval_ms=1000000000",  # keep `batches:policy` whole, to check it below
    ]
    cmd = [
        sys.executable,
        "-m",
        "astraflow.cli",
        "run",
        "recipes/addition-tiny.yaml",
        "--run",
        "chaos",
        "--keep-redis",
    ]
    for s in sets:
        cmd += ["--set", s]
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    server = None
    try:
        for name in ("raas-0", "dataflow", "trainer-policy"):
            before = steps_done(run_dir)
            wait_for(lambda b=before: steps_done(run_dir) >= b + 5, 180, f"progress before killing {name}")
            pid = json.loads((run_dir / "pids.json").read_text())[name]
            os.kill(pid, signal.SIGKILL)
            wait_for(
                lambda n=name, p=pid: json.loads((run_dir / "pids.json").read_text()).get(n) not in (None, p),
                60,
                f"{name} restarted",
            )
        out, _ = launcher.communicate(timeout=400)
        assert launcher.returncode == 0, out[-3000:]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["stopped"] == f"{STEPS} steps" and summary["ledger"]["balanced"], summary
        assert all(summary["restarts"][n] >= 1 for n in ("raas-0", "dataflow", "trainer-policy"))

        server = redis_server.load(run_dir / "redis")
        r = redis.Redis.from_url(server.url)
        manifests = [k.decode().rsplit(":", 1)[1] for k in r.scan_iter("af:{chaos}:weights:policy:*")]
        published = sorted(int(v) for v in manifests if v.isdigit())
        assert published == list(range(published[-1] + 1)) and published[-1] >= STEPS  # no gap
        noticed = [int(f[b"version"]) for _, f in r.xrange("af:{chaos}:notices")]
        every = 50  # the recipe's trainer.checkpoint_every: versions past a checkpoint are not durable
        for a, b in itertools.pairwise(noticed):  # forward; back only to a checkpoint, after the kill
            assert b > a or (b % every == 0 and b <= a), noticed
        latest = sorted((run_dir / "checkpoints" / "policy").glob("v*"))[-1]
        consumed = json.loads((latest / "meta.json").read_text())["consumed"]
        groups = {
            f[b"uid"].decode(): f[b"groups"].decode().split()
            for _, f in r.xrange("af:{chaos}:batches:policy")
        }
        trained = [g for b in consumed for g in groups[b]]
        assert len(trained) == len(set(trained)), "a group was trained twice"
    finally:
        end_kept_run(launcher, server, run_dir)


def end_kept_run(launcher: subprocess.Popen, server, run_dir) -> None:
    """Kill a launcher still running and stop the Redis it kept (`--keep-redis`)."""
    if launcher.poll() is None:
        launcher.kill()
        launcher.wait()
    server = server or redis_server.load(run_dir / "redis")
    if server is not None and server.alive():
        server.stop()


def start_run(run_dir, name: str) -> subprocess.Popen:
    """`astraflow run` of the default recipe in `run_dir`, hf engine, no stop condition."""
    cmd = [sys.executable, "-m", "astraflow.cli", "run", "recipes/addition-tiny.yaml", "--run", name]
    for s in (f"run.dir={run_dir}", "engine.type=hf", "run.target_reward=null"):
        cmd += ["--set", s]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_ctrl_c_stops_every_process_and_leaves_the_report(tmp_path):
    run_dir = tmp_path / "run"
    launcher = start_run(run_dir, "ctrl-c")
    try:
        wait_for(lambda: steps_done(run_dir) >= 3, 180, "the first steps")
        pids = json.loads((run_dir / "pids.json").read_text())
        launcher.send_signal(signal.SIGINT)
        time.sleep(0.5)
        launcher.send_signal(signal.SIGINT)  # impatient: a second Ctrl-C must not cut the clean-up short
        out, _ = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 130, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped"] == "interrupted (Ctrl-C)" and summary["ledger"]["balanced"], summary
    assert (run_dir / "reward.png").exists()
    # Every worker and what it started in its session (engines, reward pools) is gone: SIGKILLed ones may
    # take a moment to die, and orphans linger as zombies until whoever adopted them reaps them.
    for pid in pids.values():
        wait_for(lambda p=pid: not running_in_group(p), 15, f"session {pid} gone")


def running_in_group(pgid: int) -> list[int]:
    """Pids of live (not zombie) processes in process group `pgid`."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        state, _, pgrp = stat.rsplit(")", 1)[1].split()[:3]
        if int(pgrp) == pgid and state != "Z":
            out.append(int(name))
    return out

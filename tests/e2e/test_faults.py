"""Faults a shared Redis and a wide network bring, during one short `astraflow run` on an external Redis:
Redis refuses writes (`maxmemory` 1 MB for 5 s), Redis restarts (AOF), and a peer that accepts weight
pulls and then never answers is the newest peer of every version for a while. The run completes without
a restart of any worker, the ledger balances with nothing dead, no worker restarted, and nothing is
stranded (no entry stays pending past the lease)."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import redis

from astraflow import redis_server
from tests.e2e.test_chaos import steps_done, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]
STEPS = 400  # the run must outlive the checks below (16 s after step ~20): 100 ended before them
LEASE_MS = 3000
RUN = "faults"


class StalledPeer:
    """Accepts connections and never answers: a RaaS whose process froze, or a link that went dark."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def advertise(self, r: redis.Redis, seconds: float) -> int:
        """For `seconds`, make this the newest peer of every version published; returns how many."""
        deadline, seen = time.monotonic() + seconds, set()
        while time.monotonic() < deadline:
            for key in r.scan_iter(f"af:{{{RUN}}}:weights:policy:*"):
                if key.endswith(b":peers") or key in seen:
                    continue
                seen.add(key)
                r.zadd(key + b":peers", {f"local|{self.endpoint}": time.time() + 3600})
            time.sleep(0.05)
        return len(seen)

    def close(self) -> None:
        self.sock.close()
        for c in self.held:
            c.close()


def overdue(r: redis.Redis) -> set[tuple[bytes, bytes]]:
    """Pending entries of every group of the run idle past the lease."""
    out = set()
    for key in r.scan_iter(f"af:{{{RUN}}}:*", _type="stream"):
        for g in r.xinfo_groups(key):
            for p in r.xpending_range(key, g["name"], "-", "+", 1000):
                if p["time_since_delivered"] > LEASE_MS:
                    out.add((key, p["message_id"]))
    return out


def test_run_rides_out_redis_oom_restart_and_a_stalled_peer(tmp_path):
    run_dir = tmp_path / "run"
    server = redis_server.start(tmp_path / "redis", appendfsync="always")
    r = redis.Redis.from_url(server.url)
    cmd = [sys.executable, "-m", "astraflow.cli", "run", "recipes/addition-tiny.yaml", "--run", RUN]
    for s in (
        f"run.dir={run_dir}",
        "engine.type=hf",
        "run.target_reward=null",
        f"run.max_steps={STEPS}",
        f"streams.lease_ms={LEASE_MS}",
    ):
        cmd += ["--set", s]
    env = {**os.environ, "ASTRAFLOW_REDIS__URL": server.url}  # not on the command line: it has a password
    launcher = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peer = StalledPeer()
    try:
        wait_for(lambda: steps_done(run_dir) >= 10, 240, "the first steps")
        r.config_set("maxmemory", "1mb")  # every write is refused with an OOM error reply
        time.sleep(5)
        r.config_set("maxmemory", "0")

        before = steps_done(run_dir)
        wait_for(lambda: steps_done(run_dir) >= before + 5, 120, "progress after the squeeze")
        r.close()
        server.stop()  # SHUTDOWN: the AOF is complete (appendfsync always)
        time.sleep(3)
        server = redis_server.start(tmp_path / "redis", port=server.port, password=server.password)
        r = redis.Redis.from_url(server.url)

        before = steps_done(run_dir)
        wait_for(lambda: steps_done(run_dir) >= before + 5, 120, "progress after the restart")
        assert peer.advertise(r, 10) > 0, "no version published while the peer was advertised"
        first = overdue(r)  # released or stranded; a released entry is taken again within half a lease
        time.sleep(2 * LEASE_MS / 1000)
        assert not first & overdue(r), "entries stranded past the lease"
        assert launcher.poll() is None, "the run ended before the checks: raise STEPS"

        out, _ = launcher.communicate(timeout=400)
        assert launcher.returncode == 0, out[-3000:]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["stopped"] == f"{STEPS} steps", summary
        assert summary["ledger"]["balanced"] and summary["ledger"]["dead"] == 0, summary
        assert not any(summary["restarts"].values()), summary["restarts"]
        assert r.xlen(f"af:{{{RUN}}}:dead") == 0
    finally:
        peer.close()
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGINT)
            try:
                launcher.wait(60)
            except subprocess.TimeoutExpired:
                launcher.kill()
                launcher.wait()
        if server.alive():
            server.stop()

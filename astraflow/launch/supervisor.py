"""Worker processes of a run: started in their own sessions, restarted when they die, stopped cleanly.

Every process is ours by pid (and its session, for what it started itself: engine servers, reward
pools); nothing is ever found or killed by name.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)


@dataclass
class Worker:
    name: str
    module: str
    """`python -m <module>` (a `workers.*` entry point)."""
    env: dict[str, str]
    log_path: Path
    args: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = None
    restarts: int = 0
    exit_codes: list[int] = field(default_factory=list)


class Supervisor:
    def __init__(self, max_restarts: int = 5, pids_path: Path | None = None) -> None:
        self.max_restarts, self.pids_path = max_restarts, pids_path
        """`pids.json` in the run directory: name -> pid of every live worker (for operators and tests)."""
        self.workers: dict[str, Worker] = {}

    def start(self, worker: Worker) -> None:
        worker.log_path.parent.mkdir(parents=True, exist_ok=True)
        out = open(worker.log_path, "ab")  # the child keeps its own descriptor
        worker.proc = subprocess.Popen(
            [sys.executable, "-m", worker.module, *worker.args],
            env={**os.environ, **worker.env},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        out.close()
        self.workers[worker.name] = worker
        log.info("worker_started", worker=worker.name, pid=worker.proc.pid)
        if self.pids_path is not None:
            tmp = self.pids_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.pids()))
            tmp.replace(self.pids_path)

    def check(self) -> list[str]:
        """Restart workers that died; returns the names restarted. Raises when one dies too often."""
        restarted = []
        for w in self.workers.values():
            if w.proc is None or w.proc.poll() is None:
                continue
            code = w.proc.returncode
            w.exit_codes.append(code)
            _end_session(w.proc.pid)
            if w.restarts >= self.max_restarts:
                raise RuntimeError(
                    f"{w.name} died {w.restarts + 1} times (last exit {code}); see {w.log_path}"
                )
            w.restarts += 1
            log.warning("worker_restarting", worker=w.name, exit=code, restarts=w.restarts)
            self.start(w)
            restarted.append(w.name)
        return restarted

    def pids(self) -> dict[str, int]:
        return {
            n: w.proc.pid for n, w in self.workers.items() if w.proc is not None and w.proc.poll() is None
        }

    def cpu_s(self) -> dict[str, float]:
        """CPU seconds (user + system) of each live worker's current process so far."""
        return {n: cpu_seconds(pid) for n, pid in self.pids().items()}

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM every worker, wait up to `grace_s`, then SIGKILL what is left (sessions included)."""
        live = [w.proc for w in self.workers.values() if w.proc is not None and w.proc.poll() is None]
        for p in live:
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in live:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for w in self.workers.values():
            if w.proc is not None:
                _end_session(w.proc.pid)


def _end_session(pid: int) -> None:
    """Kill whatever is left in the session our worker `pid` led (servers or pools it started)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` (0.0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

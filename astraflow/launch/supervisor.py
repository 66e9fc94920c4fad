"""Worker processes of a run: started in their own sessions, restarted when they die, stopped cleanly.

Every process is ours by pid (and its session, for what it started itself: engine servers, reward
pools); nothing is ever found or killed by name.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from astraflow.errors import WorkerFailed
from astraflow.processes import die_with_parent

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
    """Restarts over the whole run (for the report)."""
    exit_codes: list[int] = field(default_factory=list)
    restarted_at: deque[float] = field(default_factory=deque)
    log_start: int = 0
    """Where the current process's output begins in its log (each start appends)."""
    """When it was restarted, within the supervisor's restart window."""


class Supervisor:
    """Starts workers, restarts one that dies - at most `max_restarts` times in any `restart_window_s`
    (a worker that crashes now and then over a long run is restarted each time; one that keeps crashing
    stops the run) - and stops them all, allowing each `grace_s` to finish cleanly."""

    def __init__(
        self,
        max_restarts: int = 5,
        pids_path: Path | None = None,
        *,
        restart_window_s: float = 600.0,
        grace_s: float = 20.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_restarts, self.pids_path = max_restarts, pids_path
        """`pids.json` in the run directory: name -> pid of every live worker (for operators and tests)."""
        self.restart_window_s, self.grace_s, self.clock = restart_window_s, grace_s, clock
        self.workers: dict[str, Worker] = {}

    def start(self, worker: Worker) -> None:
        worker.log_path.parent.mkdir(parents=True, exist_ok=True)
        out = open(worker.log_path, "ab")  # the child keeps its own descriptor
        worker.log_start = out.seek(0, os.SEEK_END)
        worker.proc = subprocess.Popen(
            [sys.executable, "-m", worker.module, *worker.args],
            env={**os.environ, **worker.env},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent(signal.SIGTERM),  # a killed launcher still stops its workers
        )
        out.close()
        self.workers[worker.name] = worker
        log.info("worker_started", worker=worker.name, pid=worker.proc.pid)
        if self.pids_path is not None:
            tmp = self.pids_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.pids()))
            tmp.replace(self.pids_path)

    def check(self) -> list[str]:
        """Restart workers that died; returns the names restarted. Raises WorkerFailed (with the worker's
        last error line) when one died more than `max_restarts` times within the last `restart_window_s`."""
        restarted = []
        for w in self.workers.values():
            if w.proc is None or w.proc.poll() is None:
                continue
            code = w.proc.returncode
            w.exit_codes.append(code)
            _end_session(w.proc.pid)
            now = self.clock()
            while w.restarted_at and now - w.restarted_at[0] >= self.restart_window_s:
                w.restarted_at.popleft()
            if len(w.restarted_at) >= self.max_restarts:
                deaths = len(w.restarted_at) + 1
                times = "once" if deaths == 1 else f"{deaths} times"
                error = last_error(w.log_path, w.log_start)
                raise WorkerFailed(
                    f"{w.name} died {times} in {self.restart_window_s:.0f}s ({_exit(code)})"
                    f"{f': {error}' if error else ''}; see {w.log_path}",
                    w.name,
                    error,
                )
            w.restarted_at.append(now)
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

    def stop(self) -> None:
        """SIGTERM every worker, wait up to `grace_s`, then SIGKILL what is left (sessions included)."""
        live = [w.proc for w in self.workers.values() if w.proc is not None and w.proc.poll() is None]
        for p in live:
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
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


TAIL_BYTES = 64 * 1024
_TRACEBACK = re.compile(r"^(?P<prefix>[ |+-]*)Traceback \(most recent call last\):")


def _exit(code: int) -> str:
    if code >= 0:
        return f"last exit {code}"
    try:
        return f"last killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"last killed by signal {-code}"


def last_error(log_path: Path, start: int = 0) -> str | None:
    """The last error a worker's log shows, in one line: the final line of its last traceback (`Type:
    message`, that of the innermost exception of a group), or the last error-level event of its JSON
    log, whichever came later; None when it shows neither (or cannot be read). Read from byte `start`
    on: the output of the process that died (an earlier one's error is not its cause)."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(f.seek(0, os.SEEK_END) - TAIL_BYTES, start))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for i in range(len(lines) - 1, -1, -1):
        if (m := _TRACEBACK.match(lines[i])) is not None:
            prefix = m["prefix"]
            for line in lines[i + 1 :]:
                rest = line[len(prefix) :] if line.startswith(prefix) else None
                if rest and not rest[0].isspace():
                    return rest.strip()
            return None
        event = _error_event(lines[i])
        if event is not None:
            return event
    return None


def _error_event(line: str) -> str | None:
    """`event: error` of a JSON log line at level error or critical, else None."""
    if not line.startswith("{") or '"level": "' not in line:
        return None
    try:
        event = json.loads(line)
    except ValueError:
        return None
    if event.get("level") not in ("error", "critical"):
        return None
    detail = (
        event.get("error") or event.get("detail") or (event.get("exception") or "").strip().split("\n")[-1]
    )
    return f"{event.get('event')}: {detail}" if detail else str(event.get("event"))


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` (0.0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

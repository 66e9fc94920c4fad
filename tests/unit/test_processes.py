"""Process lifecycle: a child started with `die_with_parent` ends when its parent is killed (the vLLM
server of a RaaS, the workers of a launcher), and a worker whose stop then hangs ends it itself (one
started otherwise never does); the supervisor budgets restarts per time window."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from astraflow.errors import WorkerFailed
from astraflow.launch.supervisor import Supervisor, Worker, last_error
from tests.e2e.test_signals import alive

pytestmark = pytest.mark.timeout(60)

PARENT = """
import signal, subprocess, sys, time
from astraflow.processes import die_with_parent
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                         start_new_session=True, preexec_fn=die_with_parent(signal.SIGTERM))
print(child.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")
def test_a_child_in_its_own_session_ends_when_its_parent_is_killed():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    assert alive(child)
    parent.kill()  # SIGKILL: no clean-up of its own runs
    parent.wait()
    deadline = time.monotonic() + 30
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(child)


STUCK = """
import asyncio, signal, sys
from astraflow.launch.worker_loop import stopper

async def main():
    loop, stop = asyncio.get_running_loop(), asyncio.Event()
    grace, redis_at = (float(sys.argv[1]), ("127.0.0.1", int(sys.argv[2]))) if sys.argv[1:] else (1.0, None)
    loop.add_signal_handler(signal.SIGTERM, stopper(stop, loop, grace, redis_at))
    print("ready", flush=True)
    await stop.wait()
    await asyncio.sleep(60)  # a stop stuck on a Redis gone with the launcher

asyncio.run(main())
"""
LAUNCHER = """
import signal, subprocess, sys, time
from astraflow.processes import die_with_parent
worker = subprocess.Popen([sys.executable, "-c", sys.argv[2], *sys.argv[3:]], start_new_session=True,
                          preexec_fn=die_with_parent(signal.SIGTERM) if sys.argv[1] == "1" else None)
print(worker.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")
@pytest.mark.parametrize("with_parent", [True, False])
def test_a_stuck_stop_ends_only_in_a_worker_whose_launcher_died(with_parent):
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, "1" if with_parent else "0", STUCK],
        stdout=subprocess.PIPE,
        text=True,
    )
    worker = int(launcher.stdout.readline())
    try:
        assert launcher.stdout.readline().strip() == "ready"
        os.kill(worker, signal.SIGTERM)  # a stop begins (Ctrl-C of the run) ...
        time.sleep(0.5)
        launcher.kill()  # ... and the launcher is killed while it waits for it
        launcher.wait()
        if not with_parent:  # started on its own (nohup): its stop is an operator's, however long it takes
            os.kill(worker, signal.SIGTERM)
        deadline = time.monotonic() + (20 if with_parent else 4)
        while alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert alive(worker) is not with_parent
    finally:
        if alive(worker):
            os.kill(worker, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")
@pytest.mark.parametrize("redis_listens", [True, False])
def test_a_stop_whose_launcher_and_redis_died_ends_without_waiting_out_its_grace(redis_listens):
    """The embedded Redis dies with a killed launcher: its workers' stops cannot finish, so they end as
    soon as nothing listens at the Redis address, not after the grace (60 s here). While something still
    listens (a Redis restarting elsewhere, a proxy), the stop keeps its grace."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    if not redis_listens:
        listener.close()
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, "1", STUCK, "60", str(port)], stdout=subprocess.PIPE, text=True
    )
    worker = int(launcher.stdout.readline())
    try:
        assert launcher.stdout.readline().strip() == "ready"
        os.kill(worker, signal.SIGTERM)
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 6
        while alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert alive(worker) is redis_listens
    finally:
        listener.close()
        if alive(worker):
            os.kill(worker, signal.SIGKILL)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def crash(supervisor: Supervisor, name: str) -> list[str]:
    """Let the worker's current process end (it exits at once), then one supervisor round."""
    supervisor.workers[name].proc.wait()
    return supervisor.check()


def test_restarts_are_budgeted_per_time_window(tmp_path):
    clock = Clock()
    s = Supervisor(max_restarts=2, restart_window_s=600, clock=clock)
    s.start(Worker("w", "this", {}, tmp_path / "w.log"))  # `python -m this` prints and exits
    for _ in range(5):  # a crash now and then over a long run: restarted every time
        assert crash(s, "w") == ["w"]
        clock.now += 400
    assert s.workers["w"].restarts == 5
    assert crash(s, "w") == ["w"]  # a second one within 10 minutes of the last: still within budget
    clock.now += 1
    with pytest.raises(WorkerFailed, match="died 3 times in 600s"):  # a third: it keeps crashing
        crash(s, "w")
    s.stop()


def test_a_worker_over_its_budget_is_reported_with_its_last_error_line(tmp_path):
    s = Supervisor(max_restarts=0)
    s.start(Worker("dataflow", "tests.crashing_worker", {}, tmp_path / "dataflow.log"))
    with pytest.raises(WorkerFailed) as failed:
        crash(s, "dataflow")
    s.stop()
    error = "ValueError: train.jsonl:2: not JSON (Expecting value)"  # of the task group's one failure
    assert (failed.value.worker, failed.value.error) == ("dataflow", error)
    assert str(failed.value) == (
        f"dataflow died once in 600s (last exit 1): {error}; see {tmp_path / 'dataflow.log'}"
    )


def test_an_earlier_processs_error_is_not_blamed_on_the_last_one(tmp_path):
    (tmp_path / "w.log").write_text(CHAINED)  # a process before this launcher's
    s = Supervisor(max_restarts=0)
    s.start(Worker("w", "this", {}, tmp_path / "w.log"))  # `python -m this` prints and exits 0
    with pytest.raises(WorkerFailed) as failed:
        crash(s, "w")
    s.stop()
    assert failed.value.error is None and str(failed.value).startswith(
        "w died once in 600s (last exit 0); see"
    )


CHAINED = """{"event": "worker_started", "level": "info"}
Traceback (most recent call last):
  File "a.py", line 1, in <module>
KeyError: 'x'

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "a.py", line 3, in <module>
    raise RuntimeError("second")
RuntimeError: second
  with a second line
"""


@pytest.mark.parametrize(
    ("log", "line"),
    [
        (CHAINED, "RuntimeError: second"),  # the exception that ended it
        (
            CHAINED + '{"event": "stop_overran", "level": "error", "detail": "the parent is gone"}\n',
            "stop_overran: the parent is gone",
        ),  # a later error event
        ('{"event": "started", "level": "info"}\n{"event": "weights_failed", "level": "warning"}\n', None),
        ("", None),
    ],
)
def test_the_last_error_line_of_a_log(tmp_path, log, line):
    (tmp_path / "w.log").write_text(log)
    assert last_error(tmp_path / "w.log") == line
    assert last_error(tmp_path / "missing.log") is None

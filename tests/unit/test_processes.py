"""Process lifecycle: a child started with `die_with_parent` ends when its parent is killed (the vLLM
server of a RaaS, the workers of a launcher); the supervisor budgets restarts per time window."""

import subprocess
import sys
import time

import pytest

from astraflow.launch.supervisor import Supervisor, Worker
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
    with pytest.raises(RuntimeError, match="died 3 times in 600s"):  # a third: it keeps crashing
        crash(s, "w")
    s.stop()

"""Child processes that end with the process that started them, and the signals that stop a run."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG, PR_GET_PDEATHSIG = 1, 2
"""prctl(2) options: the signal the kernel sends a process when the thread that forked it exits."""

STOP_SIGNALS = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP"}
"""Signals that stop `astraflow run` cleanly (Ctrl-C; what systemd, Kubernetes and Slurm send; a closed
terminal), with the name its report gives each."""


def exit_status(signum: int) -> int:
    """The shell's convention for a process ended by signal `signum`: 128 + its number (130 for SIGINT,
    143 for SIGTERM, 129 for SIGHUP)."""
    return 128 + signum


class Stopped(BaseException):
    """A stop signal arrived outside the event loop (a BaseException, like KeyboardInterrupt: it must
    not be swallowed by an `except Exception`)."""

    def __init__(self, signum: int) -> None:
        super().__init__(STOP_SIGNALS[signal.Signals(signum)])
        self.signum = signum


def raise_stopped(signum: int, _frame) -> None:
    raise Stopped(signum)


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A `preexec_fn` after which the child gets `sig` when its parent dies, even by SIGKILL (Linux;
    elsewhere None). The parent must start it from a thread that lives as long as it does (the main
    thread): the kernel signals on the exit of the forking thread."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: the child only calls it
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, int(sig))
        if os.getppid() != parent:  # the parent died before prctl took effect: nobody would signal us
            os.kill(os.getpid(), sig)

    return preexec


def parent_death_signal() -> int:
    """The signal this process gets when its parent dies (`die_with_parent`; kept across exec); 0: none."""
    if not sys.platform.startswith("linux"):
        return 0
    sig = ctypes.c_int(0)
    ctypes.CDLL(None, use_errno=True).prctl(PR_GET_PDEATHSIG, ctypes.byref(sig))
    return sig.value


def pid_space() -> str:
    """Where this process's pid means something: the host and its PID namespace (containers of one pod,
    or with the host's network, share a host name but not their pids)."""
    import socket

    try:
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        ns = 0
    return f"{socket.gethostname()}~{ns}"


def gone(space: str, pid: int) -> bool:
    """Whether process `pid` of pid space `space` is known to have ended: only a pid of our own space
    can be checked; any other may be alive."""
    if space != pid_space():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False

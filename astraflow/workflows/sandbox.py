"""A sandboxed Python evaluator for tool calls: a fresh isolated interpreter per call, with CPU-time,
memory, process-count, disk, output and wall-clock limits, an environment of PATH alone (never the
worker's: no secret of it is inherited) and a scratch directory as its cwd.

Where the machine allows namespaces (`isolation.mode`: as root, or unprivileged in a user namespace), the
call runs in fresh PID, mount, network, IPC and UTS namespaces (see `isolation`): it sees none of the
worker's processes, environment, files, shared memory or network, writes at most `disk_mb` (a tmpfs,
never the host's disk), and ending it ends everything it started. Memory is bounded per call by
RLIMIT_AS (`memory_mb`) on each of its processes and RLIMIT_NPROC (`max_processes`, counted per call:
its own uid, or its own user namespace), so a call holds at most `memory_mb x max_processes + disk_mb`.
Elsewhere (`none`) a call is refused unless `raas.sandbox` is none (`allow`); then it runs as the worker's
user in a process group of its own, with the CPU, memory and output limits, and a warning is logged once:
it can read what the worker can (its /proc/PID/environ too), reach the network, write the worker's disk,
and a child that leaves the group survives it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import structlog

from astraflow.errors import SandboxUnavailable
from astraflow.workflows import isolation

log = structlog.get_logger(__name__)
_OUTPUT_CAP_BYTES = 1 << 20


@dataclass(frozen=True)
class ToolResult:
    ok: bool
    output: str
    """stdout then stderr, cut to `max_output_chars`; or why the call was stopped."""


# The child sets its own hard limits before running the code (no preexec_fn: unsafe in a threaded parent).
_RUNNER = """
import os, resource, sys
cpu, mem, out, procs = (int(a) for a in sys.argv[1:5])
os.chdir(sys.argv[5])
code = sys.stdin.read()
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_FSIZE, (out, out))
resource.setrlimit(resource.RLIMIT_NPROC, (procs, procs))
exec(compile(code, "<tool>", "exec"), {"__name__": "__main__"})
"""


async def run_python(
    code: str,
    *,
    cpu_s: int = 2,
    memory_mb: int = 256,
    wall_s: float = 5.0,
    max_output_chars: int = 2000,
    max_processes: int = 16,
    disk_mb: int = isolation.DISK_MB,
    namespaces: bool | None = None,
) -> ToolResult:
    """Run `code`; `namespaces`: isolate it in namespaces (None: wherever this machine allows).
    `max_processes` (RLIMIT_NPROC) counts threads too, and in user-namespaces the call's two setup
    processes; where not isolated, every process of the worker's user."""
    mode = await _mode()
    if mode.name == isolation.NONE and _policy != isolation.NONE:
        return ToolResult(False, f"refused: {_unavailable(mode)}")
    isolated = mode.name != isolation.NONE if namespaces is None else namespaces
    with tempfile.TemporaryDirectory(prefix="astraflow-tool-") as scratch:
        source, output = Path(scratch) / "tool.py", Path(scratch) / "output"
        source.write_text(code)
        limits = [str(cpu_s), str(memory_mb << 20), str(_OUTPUT_CAP_BYTES), str(max_processes)]
        uid = isolation.take_uid() if isolated and mode.name == isolation.ROOT else None
        try:
            if isolated:
                argv = [isolation.interpreter(), "-I", "-c", _RUNNER, *limits, isolation.WORKDIR]
                argv = isolation.command(Path(scratch), uid, argv, disk_mb)
            else:
                work = Path(scratch) / "work"
                work.mkdir()
                argv = [sys.executable, "-I", "-c", _RUNNER, *limits, str(work)]
            returncode, text = await _run(argv, source, output, wall_s)
            if isolated and returncode is not None:
                returncode = isolation.exit_status(returncode)
        finally:
            if uid is not None:
                isolation.release_uid(uid)
    if returncode is None:
        return ToolResult(False, f"stopped: over the {wall_s}s wall-clock limit")
    text = text[: 4 * max_output_chars].decode(errors="replace")[:max_output_chars]
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return ToolResult(False, f"stopped: over the {cpu_s}s CPU-time limit")
    if returncode == -signal.SIGXFSZ:
        return ToolResult(False, text + f"\nstopped: over the {_OUTPUT_CAP_BYTES} byte output limit")
    if returncode != 0:
        return ToolResult(False, text or f"exited with {returncode}")
    return ToolResult(True, text)


async def _run(argv: list[str], source: Path, output: Path, wall_s: float) -> tuple[int | None, bytes]:
    """(exit status, or None past `wall_s`; the output). Output goes to a file capped by RLIMIT_FSIZE (no
    pipe to fill or drain); code comes from a file."""
    with source.open("rb") as stdin, output.open("wb") as stdout:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            env=isolation.ENV,
            stdin=stdin,
            stdout=stdout,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            await asyncio.wait_for(proc.wait(), wall_s)
        except TimeoutError:
            return None, b""
        finally:
            _end_group(proc.pid)  # also whatever the tool started, even after a normal exit
            if proc.returncode is None:
                await proc.wait()
    return proc.returncode, output.read_bytes()


_warned = False


_policy = "namespaces"
"""This process's `raas.sandbox` (`allow`): anything but "none" and a tool call is never run unconfined."""


def allow(policy: str) -> None:
    """Take `raas.sandbox` for this process's tool calls (a RaaS's own, its reward processes')."""
    global _policy
    _policy = policy


def require(policy: str, tools: bool = True) -> isolation.Mode:
    """The mode tool calls run in here (`isolation.mode`, probed once per process), taking `policy`
    (`raas.sandbox`) for them. Raises SandboxUnavailable, naming the probe's error, when the mode is NONE,
    `policy` is not "none" and the worker runs `tools` (`api.runs_tools`): a worker that should confine its
    tools refuses to start rather than run them unconfined. One that runs none starts; a tool call it is
    asked for all the same (a dataset row naming a reward that runs code) is refused (`run_python`)."""
    allow(policy)
    mode = isolation.mode()
    if mode.name == isolation.NONE and policy != isolation.NONE and tools:
        raise SandboxUnavailable(_unavailable(mode))
    return mode


def _unavailable(mode: isolation.Mode) -> str:
    return (
        f"tool calls cannot be sandboxed here ({mode.reason}); set raas.sandbox: none to run tools"
        " unconfined as the worker's user"
    )


async def _mode() -> isolation.Mode:
    """How tool calls are isolated here (probed once per process); warns once if they are not."""
    global _warned
    mode = await asyncio.to_thread(isolation.mode)
    if mode.name == isolation.NONE and not _warned:
        _warned = True
        log.warning("tool_sandbox_without_namespaces", reason=mode.reason)
    return mode


def _end_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass

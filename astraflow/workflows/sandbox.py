"""A sandboxed Python evaluator for tool calls: a fresh isolated interpreter per call, in its own process
group, with CPU-time, memory and wall-clock limits, an empty environment and a scratch directory.
(No network isolation: run workers in a network namespace where tools must not reach the network.)"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

_OUTPUT_CAP_BYTES = 1 << 20


@dataclass(frozen=True)
class ToolResult:
    ok: bool
    output: str
    """stdout then stderr, cut to `max_output_chars`; or why the call was stopped."""


# The child sets its own hard limits before running the code (no preexec_fn: unsafe in a threaded parent).
_RUNNER = """
import resource, sys
cpu, mem, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
code = sys.stdin.read()
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_FSIZE, (out, out))
resource.setrlimit(resource.RLIMIT_NPROC, (64, 64))
exec(compile(code, "<tool>", "exec"), {"__name__": "__main__"})
"""


async def run_python(
    code: str, *, cpu_s: int = 2, memory_mb: int = 256, wall_s: float = 5.0, max_output_chars: int = 2000
) -> ToolResult:
    with tempfile.TemporaryDirectory(prefix="astraflow-tool-") as scratch:
        source, output = Path(scratch) / "tool.py", Path(scratch) / "output"
        source.write_text(code)
        # Output goes to a file capped by RLIMIT_FSIZE (no pipe to fill or drain); code comes from a file.
        with source.open("rb") as stdin, output.open("wb") as stdout:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-I",
                "-c",
                _RUNNER,
                str(cpu_s),
                str(memory_mb << 20),
                str(_OUTPUT_CAP_BYTES),
                cwd=scratch,
                env={"PATH": "/usr/bin:/bin"},
                stdin=stdin,
                stdout=stdout,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                await asyncio.wait_for(proc.wait(), wall_s)
            except TimeoutError:
                return ToolResult(False, f"stopped: over the {wall_s}s wall-clock limit")
            finally:
                _end_group(proc.pid)  # also whatever the tool started, even after a normal exit
                if proc.returncode is None:
                    await proc.wait()
        text = output.read_bytes()[: 4 * max_output_chars].decode(errors="replace")[:max_output_chars]
    if proc.returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return ToolResult(False, f"stopped: over the {cpu_s}s CPU-time limit")
    if proc.returncode == -signal.SIGXFSZ:
        return ToolResult(False, text + f"\nstopped: over the {_OUTPUT_CAP_BYTES} byte output limit")
    if proc.returncode != 0:
        return ToolResult(False, text or f"exited with {proc.returncode}")
    return ToolResult(True, text)


def _end_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass

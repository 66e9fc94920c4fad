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


@dataclass(frozen=True)
class ToolResult:
    ok: bool
    output: str
    """stdout then stderr, cut to `max_output_chars`; or why the call was stopped."""


# The child sets its own hard limits before running the code (no preexec_fn: unsafe in a threaded parent).
_RUNNER = """
import resource, sys
cpu, mem = int(sys.argv[1]), int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
code = sys.stdin.read()
exec(compile(code, "<tool>", "exec"), {"__name__": "__main__"})
"""


async def run_python(
    code: str, *, cpu_s: int = 2, memory_mb: int = 256, wall_s: float = 5.0, max_output_chars: int = 2000
) -> ToolResult:
    with tempfile.TemporaryDirectory(prefix="astraflow-tool-") as scratch:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-I",
            "-c",
            _RUNNER,
            str(cpu_s),
            str(memory_mb << 20),
            cwd=scratch,
            env={"PATH": "/usr/bin:/bin"},
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            out, _ = await asyncio.wait_for(proc.communicate(code.encode()), wall_s)
        except TimeoutError:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            return ToolResult(False, f"stopped: over the {wall_s}s wall-clock limit")
        finally:
            if proc.returncode is None:
                os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
    text = out.decode(errors="replace")[:max_output_chars]
    if proc.returncode == -signal.SIGXCPU or proc.returncode == -signal.SIGKILL:
        return ToolResult(False, f"stopped: over the {cpu_s}s CPU-time limit")
    if proc.returncode != 0:
        return ToolResult(False, text or f"exited with {proc.returncode}")
    return ToolResult(True, text)

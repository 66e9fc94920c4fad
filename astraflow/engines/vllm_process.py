"""The vLLM server process and the HTTP clients that talk to it.

A server is spawned in a session of its own that receives SIGTERM when this process dies (even by
SIGKILL), is healthy within its start timeout or the start fails naming its log, and is ended as a whole
group, its engine processes included. Generation and control calls get separate clients, so a control
call never waits behind generation. Nothing here knows about weights or versions.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from astraflow.engines.client import GenerationClient
from astraflow.processes import die_with_parent

if TYPE_CHECKING:
    import httpx

CONTROL_CONNECTIONS = 4
"""Connections of the control client: pause, load and resume come one at a time, health checks besides."""


def open_clients(url: str) -> tuple[GenerationClient, httpx.AsyncClient]:
    """A generation client with no cap on its connections (`engines.client`: the RaaS bounds the calls, and a
    second, lower bound here would queue them where neither the server's scheduler nor a load can see
    them), and a small control client, so that a pause or a load never waits for a connection behind
    generation."""
    import httpx

    n = CONTROL_CONNECTIONS
    small = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    control = httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(None, connect=5.0), limits=small)
    return GenerationClient(url), control


async def answers(http, path: str, timeout_s: float = 5.0) -> bool:
    """True when GET `path` on the client's server returns 200."""
    import httpx

    try:
        return (await http.get(path, timeout=timeout_s)).status_code == 200
    except httpx.HTTPError:
        return False


def spawn(cmd: list[str], env: dict[str, str], log_path: Path | None) -> subprocess.Popen:
    """Start the server `cmd`, its output appended to `log_path` (discarded without one)."""
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL
    return subprocess.Popen(
        cmd,
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # its engine processes join its session: `kill_group` ends them all
        # SIGTERM when this RaaS dies, even by SIGKILL: the server shuts down its engine processes.
        preexec_fn=die_with_parent(signal.SIGTERM),
    )


async def wait_healthy(
    proc: subprocess.Popen, healthy: Callable[[], Awaitable[bool]], timeout_s: float, log_path: Path | None
) -> None:
    """Return once `healthy()`; RuntimeError if `proc` exits first, TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not await healthy():
        if proc.poll() is not None:
            raise RuntimeError(f"vllm server exited with {proc.returncode} (log {log_path})")
        if time.monotonic() > deadline:
            raise TimeoutError(f"vllm server unhealthy after {timeout_s}s (log {log_path})")
        await asyncio.sleep(0.5)


def kill_group(proc: subprocess.Popen | None) -> None:
    """End the server and the engine processes it spawned (its own session), by its pid: SIGTERM, then
    SIGKILL to a group still there 15 s later; returns once the group is gone (or 5 s after SIGKILL)."""
    if proc is None:
        return
    for sig, wait_s in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:  # until the whole group (engine core included) is gone
            proc.poll()
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)

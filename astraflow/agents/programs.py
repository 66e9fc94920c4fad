"""The user's agent program, in one of two forms, run once per episode.

- `FunctionAgent`: an async function `module:function(client, sample)`, given an `openai.AsyncOpenAI`
  client pointed at the endpoint with the episode's key; what it returns is the reward (a number, or
  None when a verifier scores the episode).
- `CommandAgent`: an external command, given `OPENAI_BASE_URL` and `OPENAI_API_KEY` in its environment
  and the sample as JSON on stdin; the last line it prints is the reward. It runs in a session of its
  own, with none of the worker's environment but `PATH`, `HOME`, `LANG` and `PYTHONPATH` (no Redis URL,
  no push key), and its whole process group is killed when it exits or its episode ends.

Both raise `ProgramFailed` with the reason a run did not produce a reward.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import shlex
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import ssl

KEPT_ENV = ("PATH", "HOME", "LANG", "PYTHONPATH")
"""The worker's environment variables an external agent command sees (besides the OpenAI ones)."""
MAX_OUTPUT_CHARS = 2000


class ProgramFailed(Exception):
    """The program ran but produced no reward; the message is the episode's error."""


def reward_of(value: Any, needed: bool) -> float | None:
    """A program's result as a reward: a finite number; None only when not `needed` (a verifier scores)."""
    if value is None and not needed:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ProgramFailed(f"the agent returned {value!r}, not a finite number")
    return float(value)


class FunctionAgent:
    def __init__(self, fn: Callable[[Any, dict[str, Any]], Awaitable[Any]]) -> None:
        if not asyncio.iscoroutinefunction(fn):
            raise ValueError(f"agent {fn!r} is not an async function (async def f(client, sample))")
        self.fn = fn
        self._tls: ssl.SSLContext | None = None

    async def run(self, base_url: str, key: str, sample: dict[str, Any]) -> Any:
        import httpx
        from openai import AsyncOpenAI, DefaultAsyncHttpxClient  # the `agents` extra: a RaaS running agents

        # Each episode has a client (and a connection pool) of its own, but all share one TLS context:
        # building one loads the CA bundle, about 35 ms of CPU (tests/bench/agent_client.py).
        if self._tls is None:
            self._tls = httpx.create_ssl_context()
        http = DefaultAsyncHttpxClient(verify=self._tls)
        client = AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, http_client=http)
        try:
            return await self.fn(client, sample)
        finally:
            await client.close()


class CommandAgent:
    def __init__(self, command: str | list[str], env: Mapping[str, str] | None = None) -> None:
        argv = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
        if not argv:
            raise ValueError("agent command is empty")
        self.argv, self.env = argv, dict(env or {})

    @contextlib.asynccontextmanager
    async def launch(self, base_url: str, key: str) -> AsyncIterator[tuple[list[str], dict[str, str]]]:
        """(argv, environment) of one run; `python` is the RaaS's own interpreter, with its packages."""
        env = {k: os.environ[k] for k in KEPT_ENV if k in os.environ}
        env.update(self.env, OPENAI_BASE_URL=base_url, OPENAI_API_KEY=key)
        argv = [sys.executable if i == 0 and a == "python" else a for i, a in enumerate(self.argv)]
        yield argv, env

    async def run(self, base_url: str, key: str, sample: dict[str, Any]) -> str:
        async with self.launch(base_url, key) as (argv, env):
            proc = await asyncio.create_subprocess_exec(
                *argv,
                env=env,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
            )
            try:
                out, err = await proc.communicate(json.dumps(sample).encode())
            finally:  # done, timed out or cancelled: nothing it started outlives the episode
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                if proc.returncode is None:
                    await proc.wait()
        stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace")
        if proc.returncode != 0:
            raise ProgramFailed(f"agent command exited with {proc.returncode}: {stderr[-MAX_OUTPUT_CHARS:]}")
        return stdout


def printed_reward(stdout: str, needed: bool) -> float | None:
    """The reward a command printed: its last non-empty line, a number."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        return reward_of(None, needed)
    try:
        value = float(lines[-1])
    except ValueError:
        raise ProgramFailed(f"the agent command's last line is not a reward: {lines[-1][:200]!r}") from None
    return reward_of(value, needed)

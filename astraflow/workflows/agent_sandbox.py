"""An agent command run in the tool sandbox (`workflow_options.sandbox: true`).

The command runs as the tool calls of `multi_turn` do (`isolation`): fresh PID, mount, network, IPC and
UTS namespaces, a read-only root of the system's programs and the interpreter with its packages (and the
recipe's `sandbox_dirs`), a size-capped tmpfs for what it writes, as a uid of its own. Its network
namespace has nothing but loopback, where a relay started in the namespace before the command listens
(`RELAY_PORT`) and forwards each connection to the endpoint's Unix socket, which the command's root does
not show. So the command reaches the endpoint, `OPENAI_BASE_URL` pointing at the relay, and nothing else:
no other port of the host, no other host.
"""

from __future__ import annotations

import contextlib
import shlex
import tempfile
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path

from astraflow.agents.programs import CommandAgent
from astraflow.workflows import isolation

RELAY_PORT = 8000
"""Where the endpoint appears inside the command's network namespace."""
_RELAY = """
import asyncio, sys
port, path, ready = int(sys.argv[1]), sys.argv[2], sys.argv[3]
async def pipe(r, w):
    try:
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
    except OSError:
        pass
    finally:
        w.close()
async def handle(r, w):
    try:
        ur, uw = await asyncio.open_unix_connection(path)
    except OSError:
        w.close()
        return
    await asyncio.gather(pipe(r, uw), pipe(ur, w))
async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", port)
    open(ready, "w").close()
    await server.serve_forever()
asyncio.run(main())
"""


class SandboxedCommand(CommandAgent):
    """A `CommandAgent` run in the tool sandbox, reaching the endpoint at `socket` only."""

    def __init__(
        self,
        command: str | list[str],
        socket: str,
        env: Mapping[str, str] | None = None,
        dirs: Sequence[str] = (),
        disk_mb: int = isolation.DISK_MB,
    ) -> None:
        super().__init__(command, env)
        if isolation.mode().name == isolation.NONE:
            raise RuntimeError(f"the tool sandbox is not available here: {isolation.mode().reason}")
        self.socket, self.dirs, self.disk_mb = socket, list(dirs), disk_mb

    @contextlib.asynccontextmanager
    async def launch(self, base_url: str, key: str) -> AsyncIterator[tuple[list[str], dict[str, str]]]:
        q = shlex.quote
        python = isolation.interpreter()
        argv = [python if i == 0 and a == "python" else a for i, a in enumerate(self.argv)]
        uid = isolation.take_uid() if isolation.mode().name == isolation.ROOT else None
        try:
            with tempfile.TemporaryDirectory(prefix="astraflow-agent-") as scratch:
                ready = Path(scratch) / "relay-ready"
                before = [
                    "ip link set lo up",
                    f"{q(python)} -I -c {q(_RELAY)} {RELAY_PORT} {q(self.socket)} {q(str(ready))} &",
                    f"while [ ! -e {q(str(ready))} ]; do sleep 0.01; done",
                ]
                command = isolation.command(Path(scratch), uid, argv, self.disk_mb, self.dirs, before)
                url = f"http://127.0.0.1:{RELAY_PORT}/v1"
                yield command, {**isolation.ENV, **self.env, "OPENAI_BASE_URL": url, "OPENAI_API_KEY": key}
        finally:
            if uid is not None:
                isolation.release_uid(uid)

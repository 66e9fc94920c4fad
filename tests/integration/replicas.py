"""Real Redis replicas (and Sentinels) as processes the test starts and may kill -9."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import redis

from astraflow import redis_server
from tests.redis7 import system_redis

__all__ = ["system_redis"]  # the replica tests' binary


def client(server: redis_server.RedisServer) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=server.port, password=server.password, socket_timeout=5)


def attach(replica: redis_server.RedisServer, primary_port: int, password: str, wait_s: float = 20) -> None:
    """Make `replica` a replica of the primary on `primary_port`; with `wait_s`, wait until it is in sync."""
    c = client(replica)
    c.config_set("masterauth", password)
    c.replicaof("127.0.0.1", primary_port)
    deadline = time.monotonic() + wait_s
    while wait_s and c.info("replication").get("master_link_status") != "up":
        assert time.monotonic() < deadline, "replica did not sync"
        time.sleep(0.05)
    c.close()


def start_replica(root: Path, primary: redis_server.RedisServer) -> redis_server.RedisServer:
    """A redis-server that replicates `primary` (same password), in sync when this returns."""
    c = client(primary)
    c.config_set("repl-diskless-sync-delay", 0)  # (default: 5 s, waiting for more replicas to sync at once)
    c.close()
    replica = redis_server.start(root, password=primary.password, binary=system_redis(), appendfsync="always")
    attach(replica, primary.port, primary.password)
    return replica


def kill9(server: redis_server.RedisServer) -> None:
    os.kill(server.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while server.alive():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def start_sentinel(
    root: Path, primary: redis_server.RedisServer, name: str, down_after_ms: int = 500
) -> tuple[subprocess.Popen, int]:
    """A Sentinel (`redis-server CONF --sentinel`) watching `primary` as `name`, quick to fail over (a
    server silent for `down_after_ms` is down)."""
    root.mkdir(parents=True, exist_ok=True)
    port = redis_server.free_port()
    conf = root / "sentinel.conf"
    conf.write_text(
        "\n".join(
            [
                f"port {port}",
                "bind 127.0.0.1",
                f'dir "{root}"',
                f'logfile "{root / "sentinel.log"}"',
                f"sentinel monitor {name} 127.0.0.1 {primary.port} 1",
                f"sentinel auth-pass {name} {primary.password}",
                f"sentinel down-after-milliseconds {name} {down_after_ms}",
                f"sentinel failover-timeout {name} 3000",
                f"sentinel parallel-syncs {name} 1",
                "",
            ]
        )
    )
    proc = subprocess.Popen(
        [system_redis(), str(conf), "--sentinel"],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    s = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1)
    deadline = time.monotonic() + 20
    while True:
        try:
            if s.sentinel_get_master_addr_by_name(name):
                break
        except redis.ConnectionError:
            pass
        assert time.monotonic() < deadline, "sentinel did not start"
        time.sleep(0.05)
    s.close()
    return proc, port

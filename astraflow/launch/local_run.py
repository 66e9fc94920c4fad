"""What a run started on one machine holds for its life, whatever it runs (`astraflow run`'s training loop,
or the bus demo): the embedded Redis (unless one is configured), the worker processes under a
`Supervisor`, and the stop signals. `close` releases them in that order's reverse, once, however the
run ended.

Until the run's own loop takes the stop signals over (`loop.add_signal_handler`), a signal raises
`processes.Stopped` where the launcher is, so a start cut short still ends what it started.
"""

from __future__ import annotations

import signal

from astraflow import redis_server
from astraflow.config import Settings
from astraflow.launch.supervisor import Supervisor, Worker
from astraflow.launch.worker_loop import stop_grace_s
from astraflow.processes import STOP_SIGNALS, raise_stopped


class LocalRun:
    def __init__(self, settings: Settings, keep_redis: bool = False) -> None:
        """Takes the stop signals (see the module doc); starts nothing yet."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, raise_stopped)
        self.settings, self.keep_redis = settings, keep_redis
        self.server: redis_server.RedisServer | None = None
        r = settings.run
        self.supervisor = Supervisor(
            r.max_restarts,
            r.path / "pids.json",
            restart_window_s=r.restart_window_s,
            grace_s=stop_grace_s(settings),
        )

    def start_redis(self) -> str:
        """The run's Redis URL: the configured one, else an embedded redis-server started now in the run
        directory (`settings.redis.url` is set to it; it ends with this process unless `keep_redis`)."""
        if not self.settings.redis.url:
            self.server = redis_server.start(
                self.settings.run.path / "redis", with_parent=not self.keep_redis
            )
            self.settings.redis.url = self.server.url
        return self.settings.redis.url

    @property
    def redis_pid(self) -> int | None:
        """The embedded Redis's pid (None when the run uses a configured one)."""
        return self.server.pid if self.server is not None else None

    def worker(self, name: str, module: str, env: dict[str, str], *args: str) -> Worker:
        """A worker of this run: `python -m module *args`, logging to `logs/<name>.log` of the run dir."""
        return Worker(name, module, env, self.settings.run.path / "logs" / f"{name}.log", list(args))

    def close(self) -> None:
        """Stop every worker (SIGTERM, then SIGKILL after the grace), then the embedded Redis unless kept.
        Stop signals are ignored from now on: a second Ctrl-C must not cut the clean-up short."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        self.supervisor.stop()
        if self.server is not None and not self.keep_redis:
            self.server.stop()

"""Prometheus metrics of a RaaS worker (a registry of its own; served only when a port is set)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from contextlib import contextmanager
from typing import TYPE_CHECKING

from astraflow.metrics_server import WorkerMetrics

if TYPE_CHECKING:
    from astraflow.raas.settings import RaasSettings


class Metrics:
    """A RaaS worker's series (`metrics_server`): labelled `run`, `worker` and `policy` (the policies it
    serves, joined by `,`: an episode may sample several)."""

    def __init__(self, settings: RaasSettings, run: str, worker: str, policies: Iterable[str]) -> None:
        self.server = m = WorkerMetrics(run, worker)
        self.policy = ",".join(policies)
        self.episodes = m.counter("astraflow_raas_episodes", "Episodes run").of(self.policy)
        self.failed = m.counter(
            "astraflow_raas_failed_trajectories", "Trajectories failed (reward raised or timed out, ...)"
        ).of(self.policy)
        self.tokens = m.counter("astraflow_raas_generated_tokens", "Tokens sampled by the policies").of(
            self.policy
        )
        self.slots_used = m.gauge("astraflow_raas_slots_in_use", "Prompt groups held").of(self.policy)
        self.slots_total = m.gauge("astraflow_raas_slots", "Prompt groups it may hold").of(self.policy)
        self.load_seconds = m.histogram("astraflow_raas_weight_load_seconds", "Pause + load + resume").of(
            self.policy
        )
        m.serve(settings.metrics_host, settings.metrics_port, "raas.metrics_port")

    def episode(self, episodes: int, tokens: int, failed: int) -> None:
        self.episodes.inc(episodes)
        self.tokens.inc(tokens)
        self.failed.inc(failed)

    def slots(self, used: int, total: int) -> None:
        self.slots_used.set(used)
        self.slots_total.set(total)

    def loaded(self, seconds: float) -> None:
        self.load_seconds.observe(seconds)


class BusyClock:
    """Seconds during which at least one prompt group was being rolled out (the worker's generation time;
    waiting for work or for weights is not counted)."""

    def __init__(self) -> None:
        self.active, self.total, self.since = 0, 0.0, 0.0

    @contextmanager
    def running(self):
        if self.active == 0:
            self.since = time.monotonic()
        self.active += 1
        try:
            yield
        finally:
            self.active -= 1
            if self.active == 0:
                self.total += time.monotonic() - self.since

    def seconds(self) -> float:
        return self.total + (time.monotonic() - self.since if self.active else 0.0)

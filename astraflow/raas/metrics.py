"""Prometheus metrics of a RaaS worker (a registry of its own; served only when a port is set)."""

from __future__ import annotations

import time
from contextlib import contextmanager


class Metrics:
    def __init__(self, port: int) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

        self.registry = CollectorRegistry()
        self.episodes = Counter("astraflow_raas_episodes", "Episodes run", registry=self.registry)
        self.failed = Counter(
            "astraflow_raas_failed_trajectories",
            "Trajectories failed (reward raised or timed out, ...)",
            registry=self.registry,
        )
        self.tokens = Counter(
            "astraflow_raas_generated_tokens", "Tokens sampled by the policies", registry=self.registry
        )
        self.slots_used = Gauge("astraflow_raas_slots_in_use", "Prompt groups held", registry=self.registry)
        self.slots_total = Gauge(
            "astraflow_raas_slots", "Prompt groups the worker may hold", registry=self.registry
        )
        self.load_seconds = Histogram(
            "astraflow_raas_weight_load_seconds", "Pause + load + resume", registry=self.registry
        )
        if port:
            start_http_server(port, addr="127.0.0.1", registry=self.registry)

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

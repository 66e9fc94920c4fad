"""A Prometheus `/metrics` endpoint for every worker (trainer, dataflow, RaaS), each with its own registry.

Every series carries the labels `run`, `worker` (the process's consumer name) and `policy`: the policy it
measures, or, for a series of a whole worker serving several policies (a RaaS's slots), their names
joined by `,`. The trainer and the dataflow serve what they write to the run's `metrics` stream
(`StreamMetrics.observe`); the RaaS its own counters (`raas.metrics`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Literal

from astraflow import metrics_http
from astraflow.errors import ConfigError
from astraflow.streams.records import EvalResult, Record, RolloutStats, TrainerStep

LABELS = ("run", "worker", "policy")


class Series:
    """One metric family with the worker's `run` and `worker` labels bound: `of(policy)` is the child
    to update."""

    def __init__(self, metric: Any, run: str, worker: str) -> None:
        self.metric, self.run, self.worker = metric, run, worker

    def of(self, policy: str, **extra: str) -> Any:
        return self.metric.labels(run=self.run, worker=self.worker, policy=policy, **extra)


class WorkerMetrics:
    """The series of one worker process and the HTTP server that serves them (`serve`)."""

    def __init__(self, run: str, worker: str) -> None:
        from prometheus_client import CollectorRegistry

        self.run, self.worker = run, worker
        self.registry = CollectorRegistry()
        self._server: Any = None

    def _series(self, kind: str, name: str, doc: str, extra: Sequence[str] = ()) -> Series:
        import prometheus_client

        cls = getattr(prometheus_client, kind)
        return Series(cls(name, doc, [*LABELS, *extra], registry=self.registry), self.run, self.worker)

    def counter(self, name: str, doc: str, extra: Sequence[str] = ()) -> Series:
        return self._series("Counter", name, doc, extra)

    def gauge(self, name: str, doc: str, extra: Sequence[str] = ()) -> Series:
        return self._series("Gauge", name, doc, extra)

    def histogram(self, name: str, doc: str) -> Series:
        return self._series("Histogram", name, doc)

    def serve(self, host: str, port: int, setting: str) -> None:
        """Serve `/metrics` on `host:port` from a daemon thread, a bounded number of connections at once,
        each with a timeout (`metrics_http`); port 0: serve nothing. A port that cannot be bound is a
        ConfigError naming `setting` (two workers on one host given the same port)."""
        if not port:
            return
        from prometheus_client import make_wsgi_app

        try:
            self._server = metrics_http.start(make_wsgi_app(self.registry), host, port)
        except OSError as e:
            raise ConfigError(f"{setting}: cannot serve /metrics on {host}:{port}: {e.strerror}") from None

    @property
    def port(self) -> int | None:
        """The port being served, if any."""
        return self._server.server_address[1] if self._server is not None else None

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class StreamMetrics:
    """The `metrics` stream entries a worker writes, as its Prometheus series: a trainer's steps
    (`kind=trainer`), or a dataflow's collected rollouts (`kind=rollouts`) and scored eval rows
    (`kind=eval`). The series of `policies` exist (at 0) before the first entry, so a scrape shows them."""

    def __init__(self, metrics: WorkerMetrics, role: Literal["trainer", "dataflow"], policies: Iterable[str]):
        m, self.metrics, self.kinds = metrics, metrics, {}
        if role == "trainer":
            self.version = m.gauge("astraflow_trainer_version", "Newest version trained")
            self.steps = m.counter("astraflow_trainer_steps", "Trainer steps (batches trained) since start")
            self.step_stat = m.gauge(
                "astraflow_trainer_step_stat", "The last step's statistics (loss, reward_mean, ...)", ["stat"]
            )
            self.kinds[TrainerStep] = self._trainer
            seeded = [self.version, self.steps]
        else:
            self.groups = m.counter("astraflow_dataflow_rollout_groups", "Rollout groups collected")
            self.samples = m.counter("astraflow_dataflow_samples", "Trajectories collected")
            self.reward = m.gauge(
                "astraflow_dataflow_reward_mean", "Mean reward of the last rollouts collected"
            )
            self.eval_rows = m.counter("astraflow_dataflow_eval_rows", "Eval rows scored", ["dataset"])
            self.kinds.update({RolloutStats: self._rollouts, EvalResult: self._eval})
            seeded = [self.groups, self.samples, self.reward]
        for policy in policies:
            for series in seeded:
                series.of(policy)

    def observe(self, records: Iterable[Record]) -> None:
        """Count records just written to the `metrics` stream (other kinds are ignored)."""
        for r in records:
            handler = self.kinds.get(type(r))
            if handler is not None:
                handler(r)

    def _trainer(self, r: TrainerStep) -> None:
        self.version.of(r.model).set(r.version)
        self.steps.of(r.model).inc()
        for stat, value in r.stats.items():
            if isinstance(value, int | float):
                self.step_stat.of(r.model, stat=stat).set(value)

    def _rollouts(self, r: RolloutStats) -> None:
        self.groups.of(r.model).inc(r.groups)
        self.samples.of(r.model).inc(r.samples)
        if r.samples:
            self.reward.of(r.model).set(r.reward_sum / r.samples)

    def _eval(self, r: EvalResult) -> None:
        self.eval_rows.of(r.model, dataset=r.dataset).inc(r.rows)


def serve_stream_metrics(
    run: str,
    worker: str,
    role: Literal["trainer", "dataflow"],
    policies: Iterable[str],
    endpoint: tuple[str, int, str],
) -> StreamMetrics:
    """A trainer's or dataflow's series, served on `endpoint` (host, port, the port's setting; port 0:
    kept, not served)."""
    metrics = WorkerMetrics(run, worker)
    stream = StreamMetrics(metrics, role, policies)
    metrics.serve(*endpoint)
    return stream

"""Every worker's Prometheus endpoint (trainer, dataflow, RaaS), started in-process as the worker starts
it and scraped over HTTP: the series carry the `run`, `worker` and `policy` labels."""

from __future__ import annotations

import socket
import threading
import time

import fakeredis
import httpx
import pytest
from prometheus_client import CollectorRegistry, make_wsgi_app

from astraflow import metrics_http
from astraflow.dataflow.settings import DataflowSettings
from astraflow.errors import ConfigError
from astraflow.launch.build import build_dataflow, build_trainer
from astraflow.metrics_http import MAX_CONNECTIONS
from astraflow.metrics_server import WorkerMetrics
from astraflow.raas.metrics import Metrics
from astraflow.raas.settings import RaasSettings
from astraflow.redis_server import free_port
from astraflow.settings_load import load_settings
from astraflow.streams import Bus, Keys
from astraflow.trainer.settings import TrainerSettings
from tests.dataflow_helpers import roll_out


def scrape(port: int) -> str:
    reply = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
    reply.raise_for_status()
    return reply.text


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """(sample name, its labels) -> value, parsed as Prometheus parses the page."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def at(text: str, name: str, **labels: str) -> float | None:
    return samples(text).get((name, frozenset(labels.items())))


async def test_the_dataflow_serves_what_it_collected_labelled():
    port = free_port()
    sets = ["run.name=t", "dataflow.feeder.n_samples=4", "dataflow.dataset.size=50"]
    settings = load_settings(
        None, [*sets, f"dataflow.metrics_port={port}", "dataflow.metrics_host=127.0.0.1"]
    )
    server = fakeredis.FakeServer(version=(7, 0))
    client = fakeredis.FakeAsyncRedis(server=server, protocol=2)
    bus = Bus(Keys("t"), settings.streams, client, client, reconnect_max_s=1)
    df = build_dataflow(settings, bus, "dataflow-0")
    try:
        await bus.bootstrap(["policy"])
        labels = {"run": "t", "worker": "dataflow-0", "policy": "policy"}
        assert at(scrape(port), "astraflow_dataflow_samples_total", **labels) == 0  # before any rollout
        await df.feeder.step()
        await roll_out(bus, 2, lambda group, i: 1.0)
        while await df.collector.step(1):
            pass
        text = scrape(port)
        assert at(text, "astraflow_dataflow_samples_total", **labels) == 8
        assert at(text, "astraflow_dataflow_rollout_groups_total", **labels) == 2
        assert at(text, "astraflow_dataflow_reward_mean", **labels) == 1.0
    finally:
        df.collector.observe.__self__.metrics.close()  # the StreamMetrics that build_dataflow started
        await bus.close()


async def test_the_trainer_serves_its_steps_labelled(bus, tiny_model, tmp_path):
    port = free_port()
    sets = [f"trainer.model={tiny_model}", f"run.dir={tmp_path}", "run.name=t"]
    sets += [f"trainer.metrics_port={port}", "trainer.metrics_host=127.0.0.1"]
    service = build_trainer(load_settings(None, sets), bus, "policy")
    try:
        labels = {"run": "t", "worker": "trainer-policy", "policy": "policy"}
        assert at(scrape(port), "astraflow_trainer_steps_total", **labels) == 0
        service.state.version = 3
        await service._metrics("b3", {"loss": 0.5, "reward_mean": 0.25})  # what a step reports
        text = scrape(port)
        assert at(text, "astraflow_trainer_version", **labels) == 3
        assert at(text, "astraflow_trainer_steps_total", **labels) == 1
        assert at(text, "astraflow_trainer_step_stat", **labels, stat="reward_mean") == 0.25
    finally:
        service.observe.__self__.metrics.close()


def test_a_raas_serves_its_counters_labelled_for_its_policies():
    port = free_port()
    metrics = Metrics(
        RaasSettings(metrics_port=port, metrics_host="127.0.0.1"), "t", "raas-a", ["policy", "judge"]
    )
    try:
        metrics.episode(episodes=6, tokens=40, failed=1)
        metrics.slots(used=2, total=8)
        text = scrape(port)
        labels = {"run": "t", "worker": "raas-a", "policy": "policy,judge"}
        assert at(text, "astraflow_raas_episodes_total", **labels) == 6
        assert at(text, "astraflow_raas_slots_in_use", **labels) == 2
        every = [dict(names) for _, names in samples(text)]
        assert every and all({"run", "worker", "policy"} <= set(names) for names in every)
    finally:
        metrics.server.close()


def test_a_port_in_use_is_one_line_naming_the_setting():
    first = WorkerMetrics("t", "a")
    first.serve("127.0.0.1", free_port(), "x.metrics_port")
    try:
        with pytest.raises(ConfigError, match=r"^dataflow.metrics_port: cannot serve /metrics on"):
            WorkerMetrics("t", "b").serve("127.0.0.1", first.port or 0, "dataflow.metrics_port")
    finally:
        first.close()


def test_port_zero_serves_nothing():
    metrics = WorkerMetrics("t", "a")
    metrics.serve("127.0.0.1", 0, "x.metrics_port")
    assert metrics.port is None


@pytest.mark.parametrize("section", [RaasSettings, DataflowSettings, TrainerSettings])
def test_every_endpoint_listens_on_this_host_only_unless_told(section):
    port = free_port()
    metrics = WorkerMetrics("t", "a")
    metrics.serve(section().metrics_host, port, "x.metrics_port")
    try:
        assert metrics._server.server_address[0] == "127.0.0.1"
    finally:
        metrics.close()


def handler_threads() -> int:
    return sum("process_request_thread" in t.name for t in threading.enumerate())


def test_idle_connections_cost_at_most_the_cap_of_threads():
    """200 connections that send nothing (the attack held 600): the endpoint keeps MAX_CONNECTIONS of
    them, closes the rest at once, and scrapes again once they are gone."""
    metrics = WorkerMetrics("t", "a")
    metrics.counter("astraflow_probe", "A series to scrape").of("policy").inc()
    metrics.serve("127.0.0.1", free_port(), "x.metrics_port")
    idle = [socket.create_connection(("127.0.0.1", metrics.port or 0)) for _ in range(200)]
    try:

        def closed_by_server(s: socket.socket) -> bool:
            try:
                return s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
            except BlockingIOError:
                return False

        deadline = time.monotonic() + 30
        while sum(map(closed_by_server, idle)) < 200 - MAX_CONNECTIONS and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sum(map(closed_by_server, idle)) == 200 - MAX_CONNECTIONS
        assert handler_threads() <= MAX_CONNECTIONS
    finally:
        for s in idle:
            s.close()
    while handler_threads():  # each held one ends as its peer goes (pytest-timeout bounds this)
        time.sleep(0.05)
    assert "astraflow_probe_total" in scrape(metrics.port or 0)
    metrics.close()


def test_a_connection_that_sends_nothing_is_closed_after_the_timeout():
    server = metrics_http.start(make_wsgi_app(CollectorRegistry()), "127.0.0.1", free_port(), timeout_s=0.2)
    try:
        with socket.create_connection(server.server_address[:2], timeout=30) as s:
            assert s.recv(1) == b""  # closed by the server, not by this test's own timeout
    finally:
        server.shutdown()
        server.server_close()

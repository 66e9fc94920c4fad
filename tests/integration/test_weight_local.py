"""The same-host path against a real Redis: a receiver on the trainer's host copies a full version from the
trainer's buffer file (nothing streamed), a file whose bytes differ from the manifest (a half the trainer
wrote since) is refused and the version pulled over TCP, and a file that is not this host's, not there or
not that file is no source: the version streams as before."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil

import pytest

from astraflow.messages import WeightManifest, decode, encode
from astraflow.weights import local
from astraflow.weights.settings import WeightsSettings
from tests.integration.test_weights import publish, receiver, trainer

pytestmark = pytest.mark.integration


async def sent_by(pub, nbytes: int, within_s: float = 10.0) -> bool:
    """Whether the trainer's server counts `nbytes` sent: it counts a piece after `sendfile` returns, which
    on a loaded machine may come after the receiver has taken and verified the whole version."""
    deadline = asyncio.get_running_loop().time() + within_s
    while pub.server.stats["bytes"] != nbytes and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)
    return pub.server.stats["bytes"] == nbytes


@pytest.fixture
async def published(bus, tmp_path):
    """(publisher, receiver, the manifest key of version 0), both ends on this host."""
    settings = WeightsSettings(full_every=100)
    pub, state, secret = await trainer(bus, settings, tmp_path / "trainer")
    rx = receiver(bus, settings, secret, tmp_path, "rx")
    key = await publish(pub, state, 0)
    yield pub, rx, key
    rx.close()
    rx.server.close()
    await pub.close()


async def rewrite_file(bus, key: str, **changes) -> WeightManifest:
    """The manifest at `key` with its `file` changed as `changes` say (what a receiver reads)."""
    manifest = decode(await bus.redis.hgetall(key), WeightManifest)
    manifest = dataclasses.replace(manifest, file=dataclasses.replace(manifest.file, **changes))
    await bus.redis.hset(key, mapping=encode(manifest))
    return manifest


async def test_a_receiver_on_the_trainers_host_copies_the_file_and_streams_nothing(bus, published):
    pub, rx, key = published
    half = await rx.sync(key, 0)
    assert bytes(half.data) == bytes(pub.buffer.served.data)
    assert (rx.stats["local_copies"], rx.stats["full_pulls"]) == (1, 0)
    assert not pub.server.stats["bytes"]


async def test_a_file_whose_bytes_differ_is_refused_and_the_version_pulled_over_tcp(bus, published, tmp_path):
    pub, rx, key = published
    served = pub.buffer.served
    other = tmp_path / "other.safetensors"  # the half as the trainer overwrote it, a byte changed
    shutil.copyfile(served.path, other)
    with open(other, "r+b") as f:
        f.seek(served.data_offset + len(served.data) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))
    described = local.describe(other, served.data_offset)
    await rewrite_file(bus, key, path=str(other), device=described.device, inode=described.inode)
    half = await rx.sync(key, 0)
    assert bytes(half.data) == bytes(pub.buffer.served.data)
    assert (rx.stats["local_misses"], rx.stats["local_copies"], rx.stats["full_pulls"]) == (1, 0, 1)
    assert await sent_by(pub, len(served.data))


@pytest.mark.parametrize(
    "change", [{"host": "another-kernel"}, {"path": "/nonexistent/model.safetensors"}, {"inode": 0}]
)
async def test_a_file_not_on_this_host_or_not_that_file_is_no_source(bus, published, change):
    pub, rx, key = published
    await rewrite_file(bus, key, **change)
    half = await rx.sync(key, 0)
    assert bytes(half.data) == bytes(pub.buffer.served.data)
    assert (rx.stats["local_copies"], rx.stats["local_misses"], rx.stats["full_pulls"]) == (0, 0, 1)
    assert await sent_by(pub, len(pub.buffer.served.data))

"""Weights at rest and where to find them: buffer files only their user can read, buffers of dead
processes removed, a checkpoint directory loaded only when it matches its manifest's digest, and the
newest published versions found although the dataflow has trimmed `versions`."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess

import pytest

from astraflow import processes
from astraflow.config import Settings
from astraflow.errors import WeightIntegrityError
from astraflow.launch.build import raas_setup
from astraflow.messages import VersionNotice
from astraflow.raas.worker import RaasWorker
from astraflow.weights.files import buffer_root
from astraflow.weights.published import newest_published
from astraflow.weights.settings import WeightsSettings
from tests.integration.test_weights import MODEL, publish, step, trainer

pytestmark = pytest.mark.integration


async def test_weight_files_are_private_to_their_user(bus, tmp_path):
    settings = WeightsSettings(full_every=100, dir=tmp_path / "shm")
    root = buffer_root(settings, "run", "trainer-policy")
    pub, state, _ = await trainer(bus, settings, root)
    try:
        await publish(pub, state, 0)
        step(state, 0.01, 1)
        await publish(pub, state, 1)  # a delta file too
        paths = [root.parent, *root.rglob("*")]
        assert any(p.name == "1.bin" for p in paths)
        for path in paths:
            mode = stat.S_IMODE(path.stat().st_mode)
            assert mode & 0o077 == 0, f"{path.relative_to(tmp_path)} is {oct(mode)}"
    finally:
        await pub.close()


def test_buffers_of_dead_processes_are_removed_at_start(tmp_path):
    settings = WeightsSettings(dir=tmp_path)
    gone = subprocess.Popen(["true"])
    gone.wait()
    host = processes.pid_space()
    dead = tmp_path / "run" / f"raas-1.pid{gone.pid}@{host}"
    (dead / "policy" / "a").mkdir(parents=True)
    (dead / "policy" / "a" / "model.safetensors").write_bytes(b"old weights")
    live = tmp_path / "run" / f"raas-2.pid{os.getppid()}@{host}"
    elsewhere = tmp_path / "run" / f"raas-4.pid{gone.pid}@another-host~1"  # may live on a shared dir
    # same host, another container (PID namespace): its pid means nothing here
    container = tmp_path / "run" / f"raas-5.pid{gone.pid}@{socket.gethostname()}~1"
    for d in (live, elsewhere, container):
        d.mkdir()
    root = buffer_root(settings, "run", "raas-3")
    assert not dead.exists() and live.exists() and elsewhere.exists() and container.exists()
    assert root.name == f"raas-3.pid{os.getpid()}@{host}" and root.is_dir()


class FakeEngine:
    """Records what it was asked to load."""

    def __init__(self) -> None:
        self.version, self.loaded = 0, []

    async def pause(self) -> None:
        pass

    async def resume(self) -> None:
        pass

    async def load_weights(self, path: str, version: int) -> None:
        self.loaded.append(path)
        self.version = version


async def test_a_checkpoint_that_differs_from_its_manifest_is_refused(bus, tmp_path):
    settings = WeightsSettings(full_every=100)
    pub, state, _ = await trainer(bus, settings, tmp_path / "t")
    engine = FakeEngine()
    worker = RaasWorker(raas_setup(Settings()), bus, {MODEL: engine}, "raas-x", {})
    try:
        key = await publish(pub, state, 1)
        good, bad = tmp_path / "good", tmp_path / "bad"
        for d in (good, bad):
            shutil.copytree(pub.buffer.served.dir, d)
        with open(bad / "model.safetensors", "r+b") as f:  # one bit flipped at rest
            f.seek(-1, os.SEEK_END)
            last = f.read(1)[0]
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last ^ 1]))

        def notice(path) -> VersionNotice:
            return VersionNotice(
                uid="n", version=1, models={MODEL: 1}, manifests={MODEL: key}, checkpoints={MODEL: str(path)}
            )

        with pytest.raises(WeightIntegrityError):
            await worker.weights._load(MODEL, engine, 1, notice(bad))
        assert engine.loaded == []
        assert await worker.weights._load(MODEL, engine, 1, notice(good))
        assert engine.loaded == [str(good)]
    finally:
        worker.ctx.rewards.close()
        await pub.close()


async def test_the_newest_published_version_is_found_in_a_trimmed_versions_stream(bus, tmp_path):
    settings = WeightsSettings(full_every=100)
    pub, state, _ = await trainer(bus, settings, tmp_path / "t")
    try:
        for version in range(3):
            await publish(pub, state, version)
        # What the dataflow does: record the versions in the run state, then trim what it recorded.
        await bus.redis.hset(bus.keys.state, mapping={f"v:{MODEL}": 2, f"inc:{MODEL}": pub.incarnation})
        await bus.redis.xtrim(bus.keys.versions, maxlen=0)
        newest = (await newest_published(bus, [MODEL]))[MODEL]
        assert (newest.version, newest.incarnation) == (2, pub.incarnation)
        assert await bus.redis.exists(newest.manifest_key)
        await publish(pub, state, 3)  # published, not recorded yet: still in the stream
        assert (await newest_published(bus, [MODEL]))[MODEL].version == 3
    finally:
        await pub.close()

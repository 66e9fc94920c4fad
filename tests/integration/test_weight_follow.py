"""A RaaS worker (hf engine, tiny model) follows trainer versions end to end: the publisher offloads,
the dataflow's barrier announces, the worker pulls (full, then deltas), verifies and loads; afterwards
the engine's weights equal the trainer's served weights bit for bit. A notice whose trainer died before
the worker pulled is retried until the restarted trainer has republished the version; a notice of a
version its trainer no longer serves gets the newest one."""

from __future__ import annotations

import asyncio

import pytest
import torch

from astraflow.config import Settings
from astraflow.dataflow.service import Dataflow
from astraflow.engines import make_engine
from astraflow.launch.build import dataflow_setup, raas_setup
from astraflow.messages import VersionNotice, encode
from astraflow.raas.worker import RaasWorker
from astraflow.weights import layout
from astraflow.weights.published import run_secret
from astraflow.weights.publisher import WeightPublisher
from astraflow.weights.receiver import WeightReceiver
from astraflow.weights.server import WeightServer
from tests.integration.raas_helpers import wait_for

pytestmark = pytest.mark.integration


class Follower:
    """A RaaS worker (hf engine, receiver) and a dataflow replica, running until `stop`."""

    def __init__(self, bus, redis_url: str, tiny_model: str, tmp_path, secret: bytes) -> None:
        from transformers import AutoTokenizer

        s = self.settings = Settings()
        s.run.name, s.run.dir, s.redis.url = "it", tmp_path, redis_url
        s.engine.type, s.engine.model = "hf", tiny_model
        s.streams.block_ms = 100
        s.weights.same_host = False  # pulls over TCP, counted below
        self.bus, self.server = bus, WeightServer(secret)
        self.receiver = WeightReceiver(bus, s.weights, "policy", tmp_path / "r", secret, self.server)
        self.engine = make_engine(s.engine)
        tokenizer = AutoTokenizer.from_pretrained(tiny_model)
        self.worker = RaasWorker(
            raas_setup(s),
            bus,
            {"policy": self.engine},
            "raas-x",
            {"policy": tokenizer},
            {"policy": self.receiver},
        )
        self.rows = [{"prompt": "1+1=", "answer": "2"}]

    async def start(self) -> None:
        await self.engine.start()
        self.stop, self.df_stop = asyncio.Event(), asyncio.Event()
        self.tasks = [
            asyncio.create_task(self.worker.run(self.stop)),
            asyncio.create_task(
                Dataflow(dataflow_setup(self.settings), self.bus, "df", self.rows).run(self.df_stop)
            ),
        ]

    async def close(self) -> None:
        self.stop.set()
        self.df_stop.set()
        await asyncio.wait_for(asyncio.gather(*self.tasks), 30)
        await self.engine.close()
        self.receiver.close()
        self.server.close()


def served_equals_engine(pub: WeightPublisher, engine) -> bool:
    """Whether the engine's weights are the publisher's served ones, bit for bit (in bf16)."""
    served = pub.buffer.served
    for spec in pub.specs:
        expected = torch.frombuffer(
            served.data, dtype=torch.bfloat16, count=spec.nbytes // 2, offset=spec.offset
        ).view(spec.shape)
        if not torch.equal(engine.model.state_dict()[spec.name].to(torch.bfloat16), expected):
            return False
    return True


async def test_engine_weights_follow_the_trainer_bit_for_bit(bus, redis_url, tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    state = trained.state_dict()
    secret = await run_secret(bus, Settings().weights)
    f = Follower(bus, redis_url, tiny_model, tmp_path, secret)
    s, engine, receiver, rows = f.settings, f.engine, f.receiver, f.rows
    pub = WeightPublisher(bus, s.weights, "policy", layout.layout(state, "bfloat16"), tmp_path / "t", secret)
    await f.start()
    tasks, df_stop = f.tasks, f.df_stop
    try:
        g = torch.Generator().manual_seed(0)
        for version in range(4):
            if version:  # a sparse "optimizer step"
                with torch.no_grad():
                    for p in trained.parameters():
                        p.add_((torch.rand(p.shape, generator=g) < 0.02) * torch.randn(p.shape, generator=g))
            await pub.publish(trained.state_dict(), version, step=version)
            await pub.wait()
            await wait_for(lambda v=version: _at(engine, v), 30, f"engine at version {version}")
        # The engine starts at version 0 (the model directory): version 1 is a full pull, then deltas.
        assert receiver.stats["full_pulls"] == 1 and receiver.stats["delta_pulls"] == 2
        assert served_equals_engine(pub, engine)

        # The trainer dies right after publishing version 4: the notice names a manifest whose endpoint
        # is gone, and the load fails. The worker retries that notice until the restarted trainer has
        # republished version 4 (the manifest rewritten with its own endpoint; no new notice).
        df_stop.set()
        await tasks[1]
        await pub.publish(trained.state_dict(), 4, step=4)
        await pub.close()
        df_stop = asyncio.Event()
        f.df_stop = df_stop
        tasks[1] = asyncio.create_task(Dataflow(dataflow_setup(s), bus, "df", rows).run(df_stop))
        await wait_for(
            lambda: _true(receiver.stats["transfer_errors"] >= 1), 30, "the load of version 4 failed"
        )
        full = s.weights.model_copy(update={"full_every": 1})  # a trainer that serves its newest version only
        pub = WeightPublisher(bus, full, "policy", pub.specs, tmp_path / "t2", secret)
        await pub.publish(trained.state_dict(), 4, step=4)
        await pub.wait()
        await wait_for(lambda: _at(engine, 4), 30, "engine at version 4 from the restarted trainer")

        # A trainer ahead of the notices (another policy is slower): version 5 is noticed when 6 is
        # already published and 5 no longer served; the worker loads the newest published version.
        df_stop.set()
        await tasks[1]
        for version in (5, 6):
            await pub.publish(trained.state_dict(), version, step=version)
        await pub.wait()
        late = VersionNotice(
            uid="late", version=5, models={"policy": 5}, manifests={"policy": bus.keys.weights("policy", 5)}
        )
        await bus.redis.xadd(bus.keys.notices, encode(late))
        await wait_for(lambda: _at(engine, 6), 30, "engine at the newest version, 6")
    finally:
        await f.close()
        await pub.close()


async def test_a_restarted_trainer_rolls_the_engines_back_to_its_checkpoint(
    bus, redis_url, tiny_model, tmp_path
):
    """`checkpoint_every` > 1: a trainer published versions 1-3 that no checkpoint holds, and died. Its
    successor resumes from the checkpoint of version 1 and trains 2 and 3 again, differently: the engine
    drops the dead incarnation's version 3 for the new one's 1 (an older version), then follows it."""
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    secret = await run_secret(bus, Settings().weights)
    f = Follower(bus, redis_url, tiny_model, tmp_path, secret)
    specs = layout.layout(trained.state_dict(), "bfloat16")
    dead = WeightPublisher(bus, f.settings.weights, "policy", specs, tmp_path / "a", secret)
    await f.start()
    g = torch.Generator().manual_seed(0)

    def step() -> None:
        with torch.no_grad():
            for p in trained.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=g))

    try:
        checkpoint = None
        for version in range(4):
            if version:
                step()
            if version == 1:
                checkpoint = {k: v.clone() for k, v in trained.state_dict().items()}
            await dead.publish(trained.state_dict(), version, step=version, once=version in (0, 1))
            await dead.wait()
            await wait_for(lambda v=version: _at(f.engine, v), 30, f"engine at the dead trainer's {version}")
        await dead.close()

        trained.load_state_dict(checkpoint)  # the successor: back to version 1, other steps from there
        pub = WeightPublisher(bus, f.settings.weights, "policy", specs, tmp_path / "b", secret)
        await pub.publish(trained.state_dict(), 1, step=1, once=False)  # as TrainerService does: rollback
        await pub.wait()
        await wait_for(lambda: _at(f.engine, 1), 30, "engine rolled back to the new trainer's version 1")
        assert served_equals_engine(pub, f.engine)
        step()
        await pub.publish(trained.state_dict(), 2, step=2, once=False)
        await pub.wait()
        await wait_for(lambda: _at(f.engine, 2), 30, "engine at the new trainer's version 2")
        assert served_equals_engine(pub, f.engine)
        state = await f.worker.bus.redis.hgetall(bus.keys.state)
        assert state[b"v:policy"] == b"2" and state[b"inc:policy"].decode() == pub.incarnation
        await pub.close()
    finally:
        await f.close()


async def _at(engine, version: int) -> bool:
    return engine.version == version


async def _true(value: bool) -> bool:
    return value

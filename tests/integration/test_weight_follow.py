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
from astraflow.messages import VersionNotice, encode
from astraflow.raas.worker import RaasWorker
from astraflow.weights import layout
from astraflow.weights.publisher import WeightPublisher, run_secret
from astraflow.weights.receiver import WeightReceiver
from astraflow.weights.transport import WeightServer
from tests.integration.raas_helpers import wait_for

pytestmark = pytest.mark.integration


async def test_engine_weights_follow_the_trainer_bit_for_bit(bus, redis_url, tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    s = Settings()
    s.run.name, s.run.dir, s.redis.url = "it", tmp_path, redis_url
    s.engine.type, s.engine.model = "hf", tiny_model
    s.streams.block_ms = 100
    trained = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    state = trained.state_dict()
    secret = await run_secret(bus, s.weights)
    pub = WeightPublisher(bus, s.weights, "policy", layout.layout(state, "bfloat16"), tmp_path / "t", secret)
    server = WeightServer(secret)
    receiver = WeightReceiver(bus, s.weights, "policy", tmp_path / "r", secret, server, model_dir=None)
    engine = make_engine(s.engine)
    await engine.start()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    worker = RaasWorker(s, bus, {"policy": engine}, "raas-x", {"policy": tokenizer}, {"policy": receiver})
    rows = [{"prompt": "1+1=", "answer": "2"}]
    stop, df_stop = asyncio.Event(), asyncio.Event()
    tasks = [
        asyncio.create_task(worker.run(stop)),
        asyncio.create_task(Dataflow(s, bus, "df", rows).run(df_stop)),
    ]
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
        served = pub.buffer.served
        for spec in pub.specs:
            expected = torch.frombuffer(
                served.data, dtype=torch.bfloat16, count=spec.nbytes // 2, offset=spec.offset
            ).view(spec.shape)
            got = engine.model.state_dict()[spec.name].to(torch.bfloat16)
            assert torch.equal(got, expected), spec.name

        # The trainer dies right after publishing version 4: the notice names a manifest whose endpoint
        # is gone, and the load fails. The worker retries that notice until the restarted trainer has
        # republished version 4 (the manifest rewritten with its own endpoint; no new notice).
        df_stop.set()
        await tasks[1]
        await pub.publish(trained.state_dict(), 4, step=4)
        await pub.close()
        df_stop = asyncio.Event()
        tasks[1] = asyncio.create_task(Dataflow(s, bus, "df", rows).run(df_stop))
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
        stop.set()
        df_stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
        await engine.close()
        receiver.close()
        server.close()
        await pub.close()


async def _at(engine, version: int) -> bool:
    return engine.version == version


async def _true(value: bool) -> bool:
    return value

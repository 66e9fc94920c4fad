"""A RaaS worker process: `astraflow raas [RECIPE] --redis URL --run R` or `python -m workers.raas`."""

from __future__ import annotations

import asyncio
import shutil
import signal
from pathlib import Path

from astraflow import logs
from astraflow.config import Settings, load_settings
from astraflow.engines import make_engine, resolve_type
from astraflow.policies import PolicySettings
from astraflow.raas.worker import RaasWorker
from astraflow.streams import Bus
from astraflow.streams.names import hold_name
from astraflow.weights.files import buffer_root
from astraflow.weights.publisher import run_secret
from astraflow.weights.receiver import WeightReceiver
from astraflow.weights.server import WeightServer
from workers.process import process_name


def worker_id(settings: Settings) -> str:
    return process_name("raas", settings.raas.id)


async def serve(settings: Settings, url: str) -> None:
    """Start the engines (one per model), run the worker until SIGTERM/SIGINT, shut everything down."""
    wid = worker_id(settings)
    logs.configure(worker=wid, run=settings.run.name)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log_dir = settings.run.path / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    policies = [settings.policy(m) for m in settings.run.models]
    engines = {}
    for i, p in enumerate(policies):
        shared = settings.engine.port
        port = p.engine.port + i if shared and p.engine.port == shared else p.engine.port  # one per model
        engines[p.name] = make_engine(
            p.engine.model_copy(update={"port": port}), log_dir / f"{wid}-{p.name}.log"
        )
    tokenizers = {}
    for p in policies:
        if resolve_type(p.engine) != "openai":
            from transformers import AutoTokenizer

            tokenizers[p.name] = AutoTokenizer.from_pretrained(p.engine.model)
    bus = Bus.connect(url, settings.run.name, settings.redis, settings.streams, wait_out=True)
    w = settings.weights
    secret = await run_secret(bus, w)
    server = WeightServer.from_settings(secret, w)
    root = buffer_root(w, settings.run.name, wid)
    receivers = {  # a policy not trained never gets new weights
        p.name: WeightReceiver(bus, w, p.name, root, secret, server, settings.raas.region, model_dir(p))
        for p in policies
        if p.train
    }
    try:
        for engine in engines.values():
            await engine.start()
        async with hold_name(bus, wid, "raas.id"):
            await RaasWorker(settings, bus, engines, wid, tokenizers, receivers).run(stop)
    finally:
        for engine in engines.values():
            await engine.close()
        for receiver in receivers.values():
            receiver.close()
        server.close()
        shutil.rmtree(root, ignore_errors=True)
        await bus.close()


def model_dir(policy: PolicySettings) -> Path | None:
    """The engine's model directory (its config files go with every pulled version), if it has one."""
    return Path(policy.engine.model) if policy.engine.model else None


def main(settings: Settings, url: str) -> None:
    asyncio.run(serve(settings, url))


if __name__ == "__main__":
    s = load_settings()
    main(s, s.redis.url or "")

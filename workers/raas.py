"""A RaaS worker process: `astraflow raas [RECIPE] --redis URL --run R` or `python -m workers.raas`."""

from __future__ import annotations

import asyncio
import shutil
import signal
from pathlib import Path

from astraflow import logs
from astraflow.config import Settings, load_settings
from astraflow.engines import make_engine, resolve_type
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
    engines = {}
    for i, m in enumerate(settings.run.models):
        port = settings.engine.port + i if settings.engine.port else 0  # one server per model
        engines[m] = make_engine(
            settings.engine.model_copy(update={"port": port}), log_dir / f"{wid}-{m}.log"
        )
    tokenizers = {}
    if resolve_type(settings.engine) != "openai":
        from transformers import AutoTokenizer

        tokenizers = {m: AutoTokenizer.from_pretrained(settings.engine.model) for m in settings.run.models}
    bus = Bus.connect(url, settings.run.name, settings.redis, settings.streams, wait_out=True)
    w = settings.weights
    secret = await run_secret(bus, w)
    server = WeightServer.from_settings(secret, w)
    root = buffer_root(w, settings.run.name, wid)
    model_dir = Path(settings.engine.model) if settings.engine.model else None
    receivers = {
        m: WeightReceiver(bus, w, m, root, secret, server, settings.raas.region, model_dir)
        for m in settings.run.models
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


def main(settings: Settings, url: str) -> None:
    asyncio.run(serve(settings, url))


if __name__ == "__main__":
    s = load_settings()
    main(s, s.redis.url or "")

"""One service per process: what `astraflow dataflow|raas|trainer` and `python -m workers.*` run.

Each function configures logging, sets a stop event on SIGTERM/SIGINT, holds the process's consumer name
and runs the service `launch.build` assembles until it is stopped.
"""

from __future__ import annotations

import asyncio
import os

from astraflow.config import Settings
from astraflow.errors import ConfigError
from astraflow.launch.build import build_dataflow, build_raas, build_trainer
from astraflow.launch.worker_loop import process_name, run_until_signalled
from astraflow.streams import Bus


def run_dataflow(settings: Settings, url: str) -> None:
    """A dataflow replica; stateless, any number may run against one Redis."""
    name = process_name("dataflow", settings.dataflow.id)
    body = lambda bus, stop: build_dataflow(settings, bus, name).run(stop)  # noqa: E731
    asyncio.run(run_until_signalled(settings, url, name, body, "dataflow.id", "dataflow", judge=True))


def run_raas(settings: Settings, url: str) -> None:
    """A RaaS worker: its engines start first, and are shut down when it stops."""
    wid = process_name("raas", settings.raas.id)

    async def body(bus, stop) -> None:
        async with build_raas(settings, bus, wid) as worker:
            await worker.run(stop)

    asyncio.run(run_until_signalled(settings, url, wid, body, "raas.id", "raas"))


def run_trainer(settings: Settings, url: str, model: str | None = None) -> None:
    """The trainer of policy `model` (default: the first trained one); under `torchrun`, one rank."""
    name = model or settings.trained[0]
    if name not in settings.trained:
        raise ConfigError(f"--model: {name!r} is not trained in this run (trained: {settings.trained})")
    trainer = settings.policy(name).trainer
    if trainer.devices:  # before torch initialises CUDA
        os.environ["CUDA_VISIBLE_DEVICES"] = trainer.devices
    import torch  # (after CUDA_VISIBLE_DEVICES)

    from astraflow.trainer import devices, distributed

    if trainer.threads:
        torch.set_num_threads(trainer.threads)
    rank, _ = distributed.setup(devices.resolve(trainer), trainer.collective_timeout_s)
    try:
        if rank > 0:  # under torchrun: rank 0 alone talks to Redis, the others follow its commands
            bus = Bus.connect(url, settings.run.name, settings.redis, settings.streams)  # never used
            build_trainer(settings, bus, name).follow()
            return
        body = lambda bus, stop: build_trainer(settings, bus, name).run(stop)  # noqa: E731
        worker = f"trainer-{name}"
        policy = "one trainer per policy"
        asyncio.run(run_until_signalled(settings, url, worker, body, policy, "trainer", judge=True))
    finally:
        distributed.teardown()

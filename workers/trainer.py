"""A trainer process for one policy: `astraflow trainer [RECIPE] --model NAME` or `python -m workers.trainer`.

One process, or several under `torchrun` (FSDP2; gloo on CPU): rank 0 alone talks to Redis.
"""

from __future__ import annotations

import asyncio
import os

from astraflow.config import Settings, load_settings
from astraflow.errors import ConfigError
from workers.process import run_until_signalled


def main(settings: Settings, url: str, model: str | None = None) -> None:
    name = model or settings.trained[0]
    if name not in settings.trained:
        raise ConfigError(f"--model: {name!r} is not trained in this run (trained: {settings.trained})")
    trainer = settings.policy(name).trainer
    if trainer.devices:  # before torch initialises CUDA
        os.environ["CUDA_VISIBLE_DEVICES"] = trainer.devices
    import torch

    from astraflow.streams import Bus
    from astraflow.trainer import distributed
    from astraflow.trainer.service import TrainerService

    if trainer.threads:
        torch.set_num_threads(trainer.threads)
    rank, _ = distributed.setup()
    try:
        if rank > 0:  # under torchrun: rank 0 alone talks to Redis, the others follow its commands
            bus = Bus.connect(url, settings.run.name, settings.redis, settings.streams)  # never used
            TrainerService(settings, bus, name).follow()
            return
        body = lambda bus, stop: TrainerService(settings, bus, name).run(stop)  # noqa: E731
        asyncio.run(run_until_signalled(settings, url, f"trainer-{name}", body, "one trainer per policy"))
    finally:
        distributed.teardown()


if __name__ == "__main__":
    s = load_settings()
    main(s, s.redis.url or "", os.environ.get("ASTRAFLOW_POLICY"))

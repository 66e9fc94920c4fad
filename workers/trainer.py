"""A trainer process for one policy: `astraflow trainer [RECIPE] --model NAME` or `python -m workers.trainer`.

One process, or several under `torchrun` (FSDP2; gloo on CPU): rank 0 alone talks to Redis.
"""

from __future__ import annotations

import asyncio

from astraflow.config import Settings, load_settings
from workers.process import run_until_signalled


def main(settings: Settings, url: str, model: str | None = None) -> None:
    import torch

    from astraflow.streams import Bus
    from astraflow.trainer import devices, distributed
    from astraflow.trainer.service import TrainerService

    name = model or settings.run.models[0]
    if name not in settings.run.models:
        raise ValueError(f"model {name!r} is not trained in this run ({settings.run.models})")
    if settings.trainer.threads:
        torch.set_num_threads(settings.trainer.threads)
    rank, _ = distributed.setup(devices.resolve(settings.trainer))
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
    import os

    s = load_settings()
    main(s, s.redis.url or "", os.environ.get("ASTRAFLOW_POLICY"))

"""A trainer process for one policy: `astraflow trainer [RECIPE] --model NAME` or `python -m workers.trainer`.

Single process on CPU (one policy per process; run one per model).
"""

from __future__ import annotations

import asyncio

from astraflow.config import Settings, load_settings
from workers.process import run_until_signalled


def main(settings: Settings, url: str, model: str | None = None) -> None:
    import torch

    from astraflow.trainer.service import TrainerService

    name = model or settings.run.models[0]
    if name not in settings.run.models:
        raise ValueError(f"model {name!r} is not trained in this run ({settings.run.models})")
    if settings.trainer.threads:
        torch.set_num_threads(settings.trainer.threads)
    body = lambda bus, stop: TrainerService(settings, bus, name).run(stop)  # noqa: E731
    asyncio.run(run_until_signalled(settings, url, f"trainer-{name}", body))


if __name__ == "__main__":
    import os

    s = load_settings()
    main(s, s.redis.url or "", os.environ.get("ASTRAFLOW_TRAINER_MODEL"))

"""A dataflow replica: `astraflow dataflow [RECIPE] --redis URL --run R` or `python -m workers.dataflow`.

Run as many as you like against one Redis; each is stateless and may be killed at any time.
"""

from __future__ import annotations

import asyncio

from astraflow.config import Settings, load_settings
from astraflow.dataflow.service import Dataflow
from workers.process import process_name, run_until_signalled


def replica_name(settings: Settings) -> str:
    return process_name("dataflow", settings.dataflow.id)


def main(settings: Settings, url: str) -> None:
    name = replica_name(settings)
    body = lambda bus, stop: Dataflow(settings, bus, name).run(stop)  # noqa: E731
    asyncio.run(run_until_signalled(settings, url, name, body, "dataflow.id"))


if __name__ == "__main__":
    s = load_settings()
    main(s, s.redis.url or "")

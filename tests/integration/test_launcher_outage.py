"""The launcher while Redis fails it (issue 41: after one entry exhausted a stream's ids the launcher
printed "progress unavailable" every second, ran 4.6 minutes past `run.max_time_s`, and after SIGTERM
exited 1 without `summary.json`): its time limit holds, and a stop writes the report either way."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from typing import ClassVar

import pytest

from astraflow import redis_server
from astraflow.config import load_settings
from astraflow.launch import launcher

pytestmark = [pytest.mark.integration, pytest.mark.slow]


class Workers:
    """The supervisor's surface the watch uses, with no process behind it (the workers are not what is
    under test: the launcher's own loop is)."""

    workers: ClassVar[dict] = {}

    def check(self) -> list[str]:
        return []

    def cpu_s(self) -> dict[str, float]:
        return {}

    def stop(self) -> None:
        pass


def settings(url: str, tmp_path, *overrides: str):
    return load_settings(
        None,
        [
            "run.name=outage",
            f"redis.url={url}",
            f"run.dir={tmp_path}",
            "run.target_reward=null",
            "redis.reconnect_max_s=0.5",
            *overrides,
        ],
    )


@pytest.mark.parametrize("ending", ["time_limit", "sigterm"])
async def test_with_redis_gone_the_launcher_keeps_its_time_limit_and_writes_its_report(tmp_path, ending):
    server = redis_server.start(tmp_path / "redis")
    limit = ["run.max_time_s=4"] if ending == "time_limit" else []
    s = settings(server.url, tmp_path / "run", *limit)
    s.run.path.mkdir(parents=True)
    watch = asyncio.create_task(launcher._watch(s, Workers(), False, None))
    await asyncio.sleep(1.5)
    server.stop()  # every Redis call fails from here on
    if ending == "sigterm":
        await asyncio.sleep(2.0)
        os.kill(os.getpid(), signal.SIGTERM)  # (the watch's handler takes it)
    status = await asyncio.wait_for(watch, 60)
    summary = json.loads((s.run.path / "summary.json").read_text())
    if ending == "time_limit":
        assert (status, summary["stopped"]) == (0, "time limit 4s")
    else:
        assert (status, summary["stopped"]) == (143, "interrupted (SIGTERM)")
    assert summary["exit_status"] == status

"""The launcher's watch against a real Redis, without workers (issue 41): while Redis fails it (after one
entry exhausted a stream's ids the launcher printed "progress unavailable" every second, ran 4.6 minutes
past `run.max_time_s`, and after SIGTERM exited 1 without `summary.json`) its time limit holds and a stop
writes the report; a run whose every group is dead-lettered ends; a stop notice it did not write is a
claim, not a success."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from typing import ClassVar

import pytest
import redis.asyncio as aioredis

from astraflow import redis_server
from astraflow.launch import launcher
from astraflow.settings_load import load_settings
from astraflow.streams import Keys
from astraflow.streams.records import DeadLetterRecord, encode_record

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
            "run.name=outage",  # (an override may name another)
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


async def test_the_launcher_ends_a_run_whose_groups_all_die_and_doubts_a_stop_it_did_not_write(tmp_path):
    """No limit set (issue 41): every group dead-lettered ends the run with exit 5 and the last reason;
    a forged `HSET run:stop` claiming the target ends it with exit 4 and the claim quoted, not 0."""
    server = redis_server.start(tmp_path / "redis")
    try:
        s = settings(server.url, tmp_path / "dead", "run.target_reward=0.8", "run.stop_after_dead_groups=3")
        s.run.path.mkdir(parents=True)
        watch = asyncio.create_task(launcher._watch(s, Workers(), False, None))
        await asyncio.sleep(1.5)
        r = aioredis.Redis.from_url(server.url)
        letter = DeadLetterRecord("prompts", "UnknownName: workflow 'nope' is not registered", "1-0")
        await r.xadd(f"{Keys('outage').dead}", encode_record(letter))
        await r.hset(Keys("outage").ledger, mapping={"submitted": 3, "dead": 3})
        assert await asyncio.wait_for(watch, 30) == 5
        summary = json.loads((s.run.path / "summary.json").read_text())
        assert summary["stopped"].endswith("the last: UnknownName: workflow 'nope' is not registered")

        s = settings(server.url, tmp_path / "forged", "run.name=forged", "run.target_reward=0.8")
        s.run.path.mkdir(parents=True)
        watch = asyncio.create_task(launcher._watch(s, Workers(), False, None))
        await asyncio.sleep(1.5)
        await r.hset(
            f"{Keys('forged').identity}:stop",
            mapping={"stopped": 1, "stop_reason": "reward target 0.8 reached"},
        )
        assert await asyncio.wait_for(watch, 30) == 4
        summary = json.loads((s.run.path / "summary.json").read_text())
        assert summary["stopped"] == "stopped elsewhere by an unnamed writer: reward target 0.8 reached"
        await r.aclose()
    finally:
        server.stop()

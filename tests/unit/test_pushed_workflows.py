"""Workflows pushed to a run: run by a RaaS that opted in, only when signed for this run and name; nothing
else is ever unpickled, and a group naming a refused workflow is dead-lettered with the reason."""

import asyncio
import pickle
import sys
from hashlib import sha256

import cloudpickle
import pytest
from pydantic import SecretStr

from astraflow.config import Settings
from astraflow.errors import ConfigError
from astraflow.launch.build import raas_setup
from astraflow.messages import encode
from astraflow.raas.worker import RaasWorker
from astraflow.settings_load import load_settings
from astraflow.streams import Bus, Keys, Out
from astraflow.streams.identity import clear
from astraflow.streams.reap import Reaper
from astraflow.workflows.pushed import PushedWorkflow, push
from tests.unit.test_code_from_data import Idle, group, run_groups

KEY = b"the-push-key"
MODULE = """
import numpy as np

from astraflow.messages import Trajectory
from astraflow.workflows.api import EpisodeResult, RolloutWorkflow

REWARD = 0.375


class Constant(RolloutWorkflow):
    async def run_episode(self, engines, sample):
        ids = np.arange(len(sample["prompt"]), dtype=np.int32)
        n = len(ids)
        traj = Trajectory(next(iter(engines)), ids, np.zeros(n, np.float32), np.ones(n, np.uint8),
                          np.zeros(n, np.int32), REWARD)
        return EpisodeResult([traj])
"""


class Boom:
    def __reduce__(self):
        return (sys.exit, ("unpickled an unsigned payload",))


@pytest.fixture
def ref(tmp_path):
    """A workflow module only the pusher has (see `pushed`)."""
    (tmp_path / "pushed_only_here.py").write_text(MODULE)
    yield "pushed_only_here:Constant"
    sys.modules.pop("pushed_only_here", None)


@pytest.fixture
def loads(monkeypatch):
    calls = []
    real = cloudpickle.loads
    monkeypatch.setattr(cloudpickle, "loads", lambda b: calls.append(b) or real(b))
    return calls


async def pushed(bus, ref, tmp_path, key=KEY, name=None) -> bytes:
    """Push `ref` from `tmp_path` (as `name`), then forget the module: the RaaS has no such module."""
    sys.path.insert(0, str(tmp_path))
    try:
        await push(bus, key, ref, name)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(ref.partition(":")[0], None)
    return await bus.redis.hget(bus.keys.workflows, name or ref)


def accepting(key=KEY):
    return {"accept_pushed_code": True, "push_key": SecretStr(key.decode())}


async def test_a_pushed_workflow_runs_on_a_raas_without_its_module(bus, ref, tmp_path, loads):
    await pushed(bus, ref, tmp_path)
    with pytest.raises(ImportError):
        __import__("pushed_only_here")
    done, dead = await run_groups(bus, [group("g1", ref), group("g2", ref)], **accepting())
    assert dead == [] and [t.reward for g in done for t in g.trajectories] == [0.375] * 4
    assert len(loads) == 1  # loaded once, then kept


async def test_a_raas_that_does_not_accept_pushed_code_never_unpickles_it(bus, ref, tmp_path, loads):
    await pushed(bus, ref, tmp_path)
    done, dead = await run_groups(bus, [group("g1", ref)])
    assert done == [] and loads == []
    assert "does not accept pushed code (raas.accept_pushed_code)" in dead[0]["reason"]


async def test_unsigned_wrongly_signed_renamed_and_other_runs_payloads_are_refused_unloaded(
    bus, ref, tmp_path, loads
):
    raw = await pushed(bus, ref, tmp_path)
    evil = pickle.dumps(Boom())  # exits the worker if ever unpickled
    fields = {**PushedWorkflow.unpack(ref, raw).__dict__, "payload": evil, "digest": sha256(evil).hexdigest()}
    unsigned = PushedWorkflow(**{**fields, "name": "unsigned", "signature": b""})
    forged = PushedWorkflow(**{**fields, "name": "forged"})  # another payload under the real signature
    await bus.redis.hset(
        bus.keys.workflows, mapping={"unsigned": unsigned.pack(), "forged": forged.pack(), "renamed": raw}
    )
    other = Bus(Keys("t2"), bus.settings, bus.redis, bus.blocking, reconnect_max_s=2)
    await other.bootstrap(["policy"])
    await other.redis.hset(other.keys.workflows, ref, raw)  # replayed into another run

    groups = [group("g-unsigned", "unsigned"), group("g-forged", "forged"), group("g-renamed", "renamed")]
    done, dead = await run_groups(bus, groups, **accepting())
    reasons = {d["field.uid"]: d["reason"] for d in dead}
    assert done == [] and "'unsigned' refused: its signature does not verify" in reasons["g-unsigned"]
    assert "'forged' refused: its signature does not verify" in reasons["g-forged"]
    assert "'renamed' refused: it was pushed as" in reasons["g-renamed"]

    done, dead = await run_groups(bus, [group("g-key", ref)], **accepting(b"another-key"))
    assert "signature does not verify for run 't'" in dead[-1]["reason"]

    done, dead = await run_groups(other, [group("g-run", ref)], **accepting())
    assert done == [] and "signature does not verify for run 't2'" in dead[0]["reason"]
    assert loads == []  # nothing unsigned or refused was unpickled


async def test_pushing_needs_the_key_and_accepting_needs_it_too(tmp_path):
    from astraflow.cli import main

    assert main(["workflow", "push", "tests.integration.user_code:Echo", "--run", "nope"]) == 1
    with pytest.raises(ConfigError, match="accept_pushed_code needs push_key"):
        load_settings(None, ["raas.accept_pushed_code=true"])


async def test_a_push_to_run_a_is_refused_on_a_new_run_of_that_name_whose_nonce_was_rewritten_to_as(
    bus, ref, tmp_path, loads
):
    old = await pushed(bus, ref, tmp_path, name="old")  # signed for run A
    identity_a = await bus.redis.hgetall(bus.keys.identity)
    await clear(bus)  # run A is over; a new run A' of the same name starts, and a RaaS works on it
    await bus.bootstrap(["policy"])
    await pushed(bus, ref, tmp_path, name="new")  # signed for A'
    settings = Settings()
    for k, v in accepting().items():
        setattr(settings.raas, k, v)
    worker = RaasWorker(raas_setup(settings), bus, {"policy": Idle()}, "raas-t", {})
    stop = asyncio.Event()
    task = asyncio.create_task(worker.runner.run(stop))

    async def handled(g, stream):
        await bus.publish_many([Out(bus.keys.prompts, encode(g), f"prompt:{g.uid}")])
        async with asyncio.timeout(30):
            while not await bus.redis.xlen(stream):
                await Reaper(bus).sweep(bus.keys.prompts)  # (the dataflow dead-letters failed prompts)
                await asyncio.sleep(0.02)

    try:
        await handled(group("g-new", "new"), bus.keys.rollouts)
        # an attacker who kept A's identity and push writes both into A'
        await bus.redis.hset(bus.keys.identity, mapping=identity_a)
        await bus.redis.hset(bus.keys.workflows, "old", old)
        await handled(group("g-old", "old"), bus.keys.dead)
    finally:
        stop.set()
        await task
        worker.ctx.rewards.close()
    ((_, dead),) = await bus.redis.xrange(bus.keys.dead)
    assert b"the run's identity changed under this RaaS" in dead[b"reason"]
    assert len(loads) == 1  # the push made for A', never A's

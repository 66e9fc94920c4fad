"""A RaaS under its own ACL user may write no dead letter, ledger count or in-flight set, neither by hand nor
through its functions; its failed prompts - a workflow that raises, an undecodable entry - still end in
`dead` with their reason after max_deliveries, dead-lettered by the dataflow under its own user, each group
out of `in_flight` and the ledger balanced."""

from __future__ import annotations

import asyncio

import pytest
from redis.exceptions import NoPermissionError

from astraflow.dataflow.ledger import read_ledger
from astraflow.dataflow.service import Dataflow
from astraflow.errors import BusError
from astraflow.launch.build import dataflow_setup, raas_setup
from astraflow.messages import PromptGroup, encode
from astraflow.raas.worker import RaasWorker
from astraflow.streams.keys import GROUP_RAAS, Keys
from astraflow.streams.schema import Counters, DeadLetter, Entry
from tests.integration.raas_helpers import wait_for
from tests.integration.test_acl import RUN, admin, as_role, connect, denials, install, run_settings, server
from tests.unit.test_code_from_data import Idle

pytestmark = pytest.mark.integration
__all__ = ["admin", "server"]  # (fixtures)
RAISES = "tests.integration.user_code:Raises"


async def submitted(admin, k: Keys, group: PromptGroup, **fields) -> None:
    """`group` on `prompts`, in flight and counted submitted, as the feeder's submit does (`fields`
    replace fields of its entry)."""
    async with admin.pipeline(transaction=True) as pipe:
        pipe.xadd(k.prompts, {**encode(group), **fields})
        pipe.sadd(k.in_flight, group.uid)
        pipe.hincrby(k.ledger, Counters.submitted, 1)
        await pipe.execute()


async def test_a_raas_credential_cannot_dead_letter_even_through_its_functions(admin, server, tmp_path):
    """By hand it is refused too (test_acl.py's attacks): XADD dead, HINCRBY ledger, SREM in_flight."""
    passwords = await install(admin, RUN)
    settings = as_role(run_settings(server.display_url, "-", tmp_path), RUN, "raas", passwords["raas"])
    raas = connect(server.display_url, settings)
    k = Keys(RUN)
    await admin.xgroup_create(k.prompts, GROUP_RAAS, "0", mkstream=True)
    await submitted(admin, k, PromptGroup("g1", RAISES, ["policy"], 2, 0))
    kept = (k.dead, k.ledger, k.in_flight)
    before = {key: await admin.dump(key) for key in kept}
    try:
        [entry] = await raas.read(k.prompts, GROUP_RAAS, "raas-0", 1, None)
        with pytest.raises(BusError, match="no permissions"):  # its hand-off, settling the group dead
            await raas.dead_letter(entry, GROUP_RAAS, "raas-0", "forged")
        with pytest.raises(NoPermissionError):  # the dataflow's dead-lettering claim
            await raas.claim(k.prompts, GROUP_RAAS, "raas-0", mode="reap", start="-", count=10)
    finally:
        await raas.close()
    assert {key: await admin.dump(key) for key in kept} == before
    assert (await admin.xpending(k.prompts, GROUP_RAAS))["pending"] == 1  # still its, unsettled


async def test_failed_prompts_of_a_raas_are_dead_lettered_by_the_dataflow_under_their_users(
    admin, server, tmp_path
):
    passwords = await install(admin, RUN)
    base = run_settings(server.display_url, "-", tmp_path)
    base.dataflow.feeder.workflow = RAISES  # every group the feeder submits fails
    base.dataflow.feeder.min_backlog = 2
    k = Keys(RUN)
    df_settings, raas_settings = (as_role(base, RUN, role, passwords[role]) for role in ("dataflow", "raas"))
    df_bus, raas_bus = connect(server.display_url, df_settings), connect(server.display_url, raas_settings)
    rows = [{"prompt": "1+1=", "answer": "2"}] * 4
    dataflow = Dataflow(dataflow_setup(df_settings), df_bus, "df", rows=rows)
    raas = RaasWorker(raas_setup(raas_settings), raas_bus, {"policy": Idle()}, "raas-0", {})
    # An entry no RaaS can decode (another schema), of a group in flight.
    await submitted(admin, k, PromptGroup("bad-1", RAISES, ["policy"], 2, 0), **{Entry.schema: "999"})
    stop_df, stop_raas = asyncio.Event(), asyncio.Event()
    tasks = [asyncio.create_task(dataflow.run(stop_df)), asyncio.create_task(raas.runner.run(stop_raas))]

    async def letters() -> dict[str, dict[str, str]]:
        raw = [
            {a.decode(): b.decode(errors="replace") for a, b in f.items()}
            for _, f in await admin.xrange(k.dead)
        ]
        return {f[DeadLetter.settled]: f for f in raw}

    async def settled() -> bool:
        dead = await letters()
        return "bad-1" in dead and len(dead) >= 3

    try:
        await wait_for(settled, 60, "the failed prompts' dead letters")
    finally:
        stop_raas.set()
        await tasks[1]
        stop_df.set()
        await asyncio.wait_for(tasks[0], 30)
        raas.ctx.rewards.close()
    dead = await letters()
    assert "schema" in dead["bad-1"]["reason"] and "DecodeError" in dead["bad-1"]["reason"]
    raised = [d for uid, d in dead.items() if uid != "bad-1"]
    assert all("RuntimeError: workflow exploded" in d["reason"] for d in raised)
    assert {d["deliveries"] for d in dead.values()} == {"3"}  # streams.max_deliveries, no more
    assert not [uid for uid in dead if await admin.sismember(k.in_flight, uid)]
    ledger = await read_ledger(df_bus, ["policy"])
    assert ledger.problems() == [] and ledger.dead == len(dead)
    assert await denials(admin) == []  # neither the RaaS nor the dataflow was refused a command
    await df_bus.close()
    await raas_bus.close()

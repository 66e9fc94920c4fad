"""Evaluation as a service, on fakeredis: eval versions bring flagged prompt groups, scored into the
metrics stream and never batched; the barrier holds later versions back until they are collected."""

from __future__ import annotations

import asyncio
import json

import pytest

from astraflow.config import ConfigError
from astraflow.dataflow.ledger import read_ledger
from astraflow.launch.evals import EvalResults
from astraflow.messages import PromptGroup, VersionNotice, decode
from astraflow.settings_load import load_settings
from astraflow.streams.records import EvalResult, EvalSubmitted, decode_record
from astraflow.streams.schema import State
from tests.dataflow_helpers import publish_version, roll_out, train
from tests.unit.test_dataflow import make

EVAL = [
    "eval.every=2",
    "eval.datasets=[{name: add, dataset: {type: task, task: addition}, n: 3}]",
    "eval.max_new_tokens=5",
    "dataflow.feeder.min_backlog=2",
]


async def notices(bus) -> list[VersionNotice]:
    return [decode(f, VersionNotice) for _, f in await bus.redis.xrange(bus.keys.notices)]


async def prompt_groups(bus) -> list[PromptGroup]:
    return [decode(f, PromptGroup) for _, f in await bus.redis.xrange(bus.keys.prompts)]


async def eval_metrics(bus) -> list[dict[str, str]]:
    entries = await bus.redis.xrange(bus.keys.metrics)
    fields = [{k.decode(): v.decode() for k, v in f.items()} for _, f in entries]
    return [f for f in fields if f["kind"] == "eval"]


async def collect_all(df) -> None:
    while await df.collector.step(1):
        pass


async def test_an_eval_version_submits_flagged_greedy_groups_once():
    bus, df = make(*EVAL)
    await bus.bootstrap(["policy"])
    await publish_version(bus, "policy", 0, eval_=True)
    await df.barrier.step(1)
    await df.feeder.step()  # due again? no: submitted once, whichever replica got there first
    groups = await prompt_groups(bus)
    evals = [g for g in groups if g.eval_version >= 0]
    assert [g.uid for g in evals] == ["eval:0:add:0", "eval:0:add:1", "eval:0:add:2"]
    assert all(g.eval_dataset == "add" and g.n_samples == 1 for g in evals)
    assert evals[0].sampling == {"temperature": 0.0, "max_new_tokens": 5}
    assert len(groups) == 3  # they fill the backlog: training groups follow once they are taken
    [notice] = await notices(bus)
    assert notice.eval and notice.models == {"policy": 0}
    ledger = await read_ledger(bus, ["policy"])
    assert (ledger.submitted, ledger.in_flight) == (3, 3)
    await df.barrier.evals.submit(df.store, 0)  # another replica, late: nothing more
    records = [decode_record(f) for _, f in await bus.redis.xrange(bus.keys.metrics)]
    sizes = [(r.version, r.dataset, r.rows) for r in records if isinstance(r, EvalSubmitted)]
    assert sizes == [(0, "add", 3)]  # how many rows the eval has (a stop may cut it short)


def test_an_eval_cut_short_says_how_many_of_its_rows_were_scored():
    results = EvalResults()
    results.add(EvalResult("policy", "add", 0, 3, {"pass@1": 2.0}, 0), 1.0)  # scored before its size is read
    results.add(EvalSubmitted(0, "add", 3, 0), 0.5)
    results.add(EvalSubmitted(2, "add", 3, 0), 2.0)
    results.add(EvalResult("policy", "add", 2, 2, {"pass@1": 2.0}, 0), 3.0)  # the run stopped before row 3
    assert [(e["version"], e["rows"], e["of"]) for e in results.as_list()] == [(0, 3, 3), (2, 2, 3)]
    assert results.latest() == {"policy": "v2 add pass@1 1.000 (2/3 rows)"}


async def test_eval_rows_are_scored_into_metrics_and_never_batched():
    bus, df = make(*EVAL)
    await bus.bootstrap(["policy"])
    await publish_version(bus, "policy", 0, eval_=True)
    await df.barrier.step(1)
    # The eval rows: the first two get the full reward, the third half of it; then training groups.
    for _ in range(2):
        await roll_out(
            bus, 100, lambda g, i: 0.5 if g.uid == "eval:0:add:2" else float(g.eval_version == 0 or i % 2)
        )
        await collect_all(df)
        await df.feeder.step()
    while await df.former.step("policy") == "ok":
        pass
    batched = {uid for _, b in await train(bus, "policy") for uid in b.group_uids}
    assert batched and not any(uid.startswith("eval:") for uid in batched)
    [entry] = await eval_metrics(bus)
    assert (entry["model"], entry["dataset"], entry["version"], entry["rows"]) == ("policy", "add", "0", "3")
    sums = json.loads(entry["sums"])
    assert sums == {"pass@1": 2.0, "mean_reward": 2.5}
    ledger = await read_ledger(bus, ["policy"])
    assert not ledger.problems(), ledger.render()
    assert ledger.eval == 3 and ledger.collected == 5


async def test_an_eval_row_sampled_at_another_version_is_dropped_and_counted():
    bus, df = make(*EVAL)
    await bus.bootstrap(["policy"])
    await publish_version(bus, "policy", 0, eval_=True)
    await df.barrier.step(1)
    await roll_out(bus, 100, lambda g, i: 1.0, version=lambda g: 1 if g.uid == "eval:0:add:1" else 0)
    await collect_all(df)
    [entry] = await eval_metrics(bus)
    assert entry["rows"] == "2"  # the row of version 1 is not in the results
    ledger = await read_ledger(bus, ["policy"])
    assert ledger.eval_dropped == {"wrong_version": 1}
    assert not ledger.problems(), ledger.render()


async def test_the_barrier_holds_later_versions_until_the_eval_is_collected():
    bus, df = make(*EVAL)
    await bus.bootstrap(["policy"])
    await publish_version(bus, "policy", 0, eval_=True)
    await df.barrier.step(1)
    for v in (1, 2, 3):
        await publish_version(bus, "policy", v, eval_=v % 2 == 0)
    await df.barrier.step(1)
    assert [n.version for n in await notices(bus)] == [0]  # v0's eval rows are not collected yet
    await roll_out(bus, 100, lambda g, i: 1.0)
    await collect_all(df)
    await df.barrier.step(1)
    # v2 is an eval version: announced exactly (not v3), and it holds the next notices in turn.
    assert [(n.version, n.eval, n.models) for n in await notices(bus)][1:] == [(2, True, {"policy": 2})]
    assert {g.uid for g in await prompt_groups(bus)} >= {"eval:2:add:0", "eval:2:add:2"}
    await df.barrier.step(1)
    assert len(await notices(bus)) == 2


async def test_an_eval_ends_its_hold_without_waiting_for_the_next_published_version(monkeypatch):
    """While an eval holds the notices back, no trainer may publish (every batch of the held version gone
    stale): the barrier's wait for a version is cut to HOLD_POLL_MS, and the notice after the eval says how
    long it held."""
    from structlog.testing import capture_logs

    from astraflow.dataflow.barrier import HOLD_POLL_MS

    bus, df = make(*EVAL)
    await bus.bootstrap(["policy"])
    await publish_version(bus, "policy", 0, eval_=True)
    await publish_version(bus, "policy", 1)
    blocks, read = [], df.barrier.consumer.read

    async def spy(count, block_ms=None):
        blocks.append(block_ms)
        return await read(count, 1)

    monkeypatch.setattr(df.barrier.consumer, "read", spy)
    await df.barrier.step(2000)
    assert df.barrier.holding and [n.version for n in await notices(bus)] == [0]
    await roll_out(bus, 100, lambda g, i: 1.0)
    await collect_all(df)
    with capture_logs() as logs:
        await df.barrier.step(2000)
    assert blocks == [2000, HOLD_POLL_MS]
    assert [n.version for n in await notices(bus)] == [0, 1] and not df.barrier.holding
    [announced] = [e for e in logs if e["event"] == "version_announced"]
    assert 0 <= announced["eval_held_s"] < 60


async def test_a_lost_eval_holds_the_barrier_only_until_its_timeout():
    bus, df = make(*EVAL, "eval.timeout_s=0.3")
    await bus.bootstrap(["policy"])
    await publish_version(bus, "policy", 0, eval_=True)
    await df.barrier.step(1)
    await publish_version(bus, "policy", 1)
    await df.barrier.step(1)
    assert len(await notices(bus)) == 1  # nobody rolls the eval rows out
    await asyncio.sleep(0.4)
    await df.barrier.step(1)
    assert [n.version for n in await notices(bus)] == [0, 1]


def test_eval_settings_are_checked():
    with pytest.raises(ConfigError, match=r"eval\.datasets is empty"):
        load_settings(None, ["eval.every=5"])
    with pytest.raises(ConfigError, match=r"eval\.every"):
        load_settings(None, ["run.eval_every_s=5"])
    with pytest.raises(ConfigError, match=r"eval\.datasets is empty"):
        load_settings(None, ["eval.every_s=20"])


def test_an_eval_cadence_by_time_flags_version_0_then_the_first_version_past_each_interval():
    from astraflow.trainer.eval_cadence import EvalCadence

    now = [100.0]
    cadence = EvalCadence(every=0, every_s=20.0, clock=lambda: now[0])
    flagged = []
    for version in range(60):  # a version every second
        if cadence.flag(version):
            flagged.append(version)
        now[0] += 1.0
    assert flagged == [0, 20, 40]  # not every 10th: fast steps do not make evals more frequent
    restarted = EvalCadence(every=0, every_s=20.0, clock=lambda: now[0])
    assert not restarted.flag(35)  # a restart past version 0 starts the clock instead
    now[0] += 20.0
    assert restarted.flag(36)
    both = EvalCadence(every=10, every_s=1e9, clock=lambda: now[0])
    assert [v for v in range(25) if both.flag(v)] == [0, 10, 20]  # `every` still counts on its own


async def test_registered_and_workflow_metrics_score_eval_rows():
    from astraflow.dataflow.evaluation import eval_metric

    @eval_metric("test_max_reward")
    def max_reward(trajectories):
        return max(t.reward for t in trajectories)

    metrics = "eval.metrics=[pass@1, test_max_reward, tool_call]"
    bus, df = make(*EVAL, metrics, "eval.n_samples=2")
    await bus.bootstrap(["policy"])
    await publish_version(bus, "policy", 0, eval_=True)
    await df.barrier.step(1)
    # Sample 0 of each row calls the tool and is right; sample 1 does neither.
    await roll_out(bus, 100, lambda g, i: float(i == 0), metrics=lambda g, i: {"tool_call": float(i == 0)})
    await collect_all(df)
    [entry] = await eval_metrics(bus)
    assert json.loads(entry["sums"]) == {"pass@1": 1.5, "test_max_reward": 3.0, "tool_call": 1.5}


async def test_eval_rows_a_killed_replica_did_not_submit_are_submitted_by_the_next_feeder_step():
    bus, df = make(*EVAL)
    await bus.bootstrap(["policy"])
    evals, df.barrier.evals = df.barrier.evals, None  # a replica killed between announcing and submitting
    await publish_version(bus, "policy", 0, eval_=True)
    await df.barrier.step(1)
    assert [n.version for n in await notices(bus)] == [0] and not await prompt_groups(bus)
    df.barrier.evals = evals  # another replica: the unsubmitted eval holds later versions back
    await publish_version(bus, "policy", 1)
    await df.barrier.step(1)
    assert [n.version for n in await notices(bus)] == [0]
    await df.feeder.step()
    assert [g.uid for g in await prompt_groups(bus)] == ["eval:0:add:0", "eval:0:add:1", "eval:0:add:2"]


async def test_a_feeder_reads_the_whole_state_only_for_an_eval_no_one_submitted():
    """Each feeder step is one script (room, cursor, notice, and whether the notice's eval went out);
    the whole state - fields per version, the weights' manifests and eval marks - is read only for an
    eval whose groups no barrier submitted."""
    bus, df = make(*EVAL)
    await bus.bootstrap(["policy"])
    df.barrier.evals = None  # the eval's groups are left to the feeder
    reads, state = [], df.store.state

    async def read():
        reads.append(1)
        return await state()

    df.store.state = read
    await publish_version(bus, "policy", 0)
    await df.barrier.step(1)  # (it reads the state too)
    reads.clear()
    for _ in range(3):
        await df.feeder.step()
    assert reads == []  # no eval announced
    await publish_version(bus, "policy", 1, eval_=True)
    await df.barrier.step(1)
    reads.clear()
    for _ in range(3):
        await df.feeder.step()
    assert len(reads) == 1  # the eval, submitted: then no more
    evals = [g.uid for g in await prompt_groups(bus) if g.eval_version >= 0]
    assert evals == ["eval:1:add:0", "eval:1:add:1", "eval:1:add:2"]


async def test_an_eval_marked_under_a_notice_already_read_is_still_submitted():
    """A rollback announces a version again, and its restarted trainer may mark it an eval that no barrier
    then submits (its replica died): the notice did not move, and the feeder's next step finds it."""
    bus, df = make(*EVAL)
    await bus.bootstrap(["policy"])
    df.barrier.evals = None
    await publish_version(bus, "policy", 0)
    await df.barrier.step(1)
    await df.feeder.step()  # notice 0 read: no eval due
    await bus.redis.hset(bus.keys.state, State.eval(0), 1)  # (as version.lua marks one)
    await df.feeder.step()
    evals = [g.uid for g in await prompt_groups(bus) if g.eval_version >= 0]
    assert evals == ["eval:0:add:0", "eval:0:add:1", "eval:0:add:2"]

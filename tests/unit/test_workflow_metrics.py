"""A metric a workflow reports per episode (`tool_call`) goes from the rollouts through the dataflow's
metrics entries to the run's metrics.jsonl, summary.json and reward.png, averaged per trainer step."""

import json
import time

from astraflow.launch import report
from astraflow.launch.progress import Progress, line
from astraflow.streams.records import MAX_METRIC_NAMES, RolloutStats, TrainerStep, encode_record
from astraflow.tracking.feed import Feed
from tests.dataflow_helpers import roll_out
from tests.unit.test_dataflow import make


async def trainer_step(bus, version: int) -> None:
    """The entry a trainer writes after a step."""
    stats = {"reward_mean": 0.5, "samples": 16, "step_s": 0.1}
    step = TrainerStep("policy", version, f"b{version}", time.time(), stats)
    await bus.redis.xadd(bus.keys.metrics, encode_record(step))


async def test_tool_call_rate_per_step_reaches_metrics_summary_and_plot(tmp_path):
    bus, df = make("dataflow.feeder.min_backlog=4")
    await bus.bootstrap(["policy"])
    progress = Progress(bus, ["policy"], window=1, metrics_path=tmp_path / "metrics.jsonl")
    for version, calls in ((1, 1), (2, 3)):  # of each group's 4 samples, this many called the tool
        await df.feeder.step()
        uids = await roll_out(
            bus, 100, lambda g, i: float(i % 2), metrics=lambda g, i, c=calls: {"tool_call": float(i < c)}
        )
        assert uids
        while await df.collector.step(1):
            pass
        await trainer_step(bus, version)
        snap = await progress.poll()

    m = progress.models["policy"]
    assert [(v, rate) for v, _, rate in m.curves["tool_call"]] == [(1, 0.25), (2, 0.75)]
    assert "tool_call 0.750" in line(snap, 1)
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout_tool_call"] for r in records] == [0.25, 0.75]
    data = report.write(tmp_path, progress, 1, {"wall_s": 1.0})
    assert data["models"]["policy"]["tool_call_first_window"] == 0.25
    assert data["models"]["policy"]["tool_call_last_window"] == 0.75
    assert json.loads((tmp_path / "summary.json").read_text()) == json.loads(json.dumps(data))
    assert (tmp_path / "reward.png").stat().st_size > 0


async def test_a_run_without_workflow_metrics_reports_none(tmp_path):
    bus, df = make("dataflow.feeder.min_backlog=4")
    await bus.bootstrap(["policy"])
    progress = Progress(bus, ["policy"], window=1)
    await df.feeder.step()
    await roll_out(bus, 100, lambda g, i: float(i % 2))
    while await df.collector.step(1):
        pass
    await trainer_step(bus, 1)
    await progress.poll()
    assert progress.models["policy"].curves == {}
    data = report.summary(progress, 1, {})
    assert not any(k.startswith("tool_call") for k in data["models"]["policy"])


async def test_a_step_logs_only_well_named_metrics_and_at_most_the_cap(tmp_path):
    """A `metrics` entry someone else wrote (the collector refuses such rollouts): names with escape codes
    never reach a step's scalars (TensorBoard's feed, the status line, metrics.jsonl), and a step logs at
    most MAX_METRIC_NAMES of them."""
    names = {"\x1b[2J\x1b[31mwin": [1.0, 1], **{f"m{i:03}": [1.0, 1] for i in range(500)}}
    entries = [
        encode_record(RolloutStats("policy", 1, 1, 0.5, 0, names)),
        encode_record(TrainerStep("policy", 1, "b1", 0, {"loss": 0.1})),
    ]
    [(_, _, scalars)] = Feed(["policy"]).consume((f"{i}-0", e) for i, e in enumerate(entries, 1))
    bus, _ = make()
    for e in entries:
        await bus.redis.xadd(bus.keys.metrics, e)
    progress = Progress(bus, ["policy"], 1, tmp_path / "metrics.jsonl")
    await progress.read_metrics()
    [logged] = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    shown = line(await progress.poll(), 1)
    for keys in (scalars, logged):
        assert len([k for k in keys if k.startswith("rollout_m")]) == MAX_METRIC_NAMES
        assert all(k.isprintable() for k in keys)
    assert "\x1b" not in shown and shown.count(" m0") == MAX_METRIC_NAMES

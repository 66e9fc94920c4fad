"""A metric a workflow reports per episode (`tool_call`) goes from the rollouts through the dataflow's
metrics entries to the run's metrics.jsonl, summary.json and reward.png, averaged per trainer step."""

import json
import time

from astraflow.launch import report
from astraflow.launch.progress import Progress, line
from astraflow.streams.records import TrainerStep, encode_record
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

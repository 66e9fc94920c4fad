"""The live view's figures: ETA to the reward target, the staleness distribution, each RaaS's share of
time generating."""

from rich.console import Console

from astraflow.launch.progress import ModelProgress, Snapshot, line, render, staleness
from astraflow.messages import Heartbeat


def rising(n: int, per_s: float) -> ModelProgress:
    """`n` steps, one a second, the reward rising by `per_s` a second from 0.2."""
    m = ModelProgress()
    m.steps = [(i + 1, float(i), 0.2 + per_s * i) for i in range(n)]
    m.last = {"tokens_per_s": 1000.0, "staleness_0": 0.25, "staleness_1": 0.75, "staleness_mean": 0.75}
    return m


def test_eta_follows_the_recent_trend():
    m = rising(60, 0.005)
    ma = m.moving_reward(10)
    assert abs(m.eta_s(10, 0.8) - (0.8 - ma) / 0.005) < 1e-6
    assert rising(60, 0.0).eta_s(10, 0.8) is None  # flat: no estimate
    assert rising(5, 0.01).eta_s(10, 0.8) is None  # too few steps
    assert rising(60, 0.02).eta_s(10, 0.8) == 0.0  # reached


def test_staleness_distribution():
    assert staleness({"staleness_1": 0.75, "staleness_0": 0.25, "staleness_mean": 0.75}) == "0:25% 1:75%"
    assert staleness({}) == "-"


def test_live_view_and_line_show_what_a_run_is_doing():
    beat = Heartbeat(
        uid="raas-0",
        region="local",
        capacity=16,
        in_flight=8,
        versions={"policy": 59},
        endpoint=None,
        started_at=100.0,
        updated_at=140.0,
        engine="hf:tiny",
        generating_s=24.0,
    )
    snap = Snapshot(
        60.0, {"policy": rising(60, 0.005)}, None, [beat], [], evals={"policy": "v50 add pass@1 0.500"}
    )
    console = Console(record=True, width=200)
    console.print(render(snap, 10, 0.8))
    text = console.export_text()
    for expected in ("policy", "0:25% 1:75%", "raas-0", "8/16", "60%", "0.500"):  # 60%: 24 s of 40
        assert expected in text, expected
    eta = rising(60, 0.005).eta_s(10, 0.8)
    assert f"{eta:.0f}s" in text
    assert "policy v60 reward(ma10)" in line(snap, 10)
    assert "eval policy v50 add pass@1 0.500" in line(snap, 10)


def test_the_target_counts_when_the_average_crossed_it_between_two_checks():
    """The launcher checks once a second, several steps apart: a moving average that reached the target
    at a step in between and fell back still stops the run (as a loop checking every step would)."""
    from astraflow.launch.stops import reached

    steps = [(i, 0.0, r) for i, r in enumerate([0.0] * 5 + [1.0] * 10 + [0.0] * 3)]
    assert reached(steps, 10, 0.8)  # steps 6-15 averaged 1.0; the last ten average 0.7
    assert not reached(steps[:12], 10, 0.8) and not reached(steps[:3], 10, 0.8)


def test_the_launcher_shares_the_cores_out_and_reports_where_the_time_went():
    """Threads left at 0 get half the cores each in async mode (trainer and RaaS run at once), all of
    them in sync mode; a set count is kept. The run's last line reads wall time, steps, busy shares and
    each process's CPU (from /proc: this process has used some, a gone one none)."""
    import os

    from astraflow.config import Settings
    from astraflow.launch.launcher import place_threads
    from astraflow.launch.report import busy_line
    from astraflow.launch.supervisor import cpu_seconds

    cores = os.cpu_count() or 1
    s = Settings()
    place_threads(s)
    assert s.trainer.threads == s.engine.threads == max(1, cores // 2)
    s = Settings()
    s.trainer.mode, s.engine.threads = "sync", 3
    place_threads(s)
    assert (s.trainer.threads, s.engine.threads) == (cores, 3)

    assert cpu_seconds(os.getpid()) > 0 and cpu_seconds(2**22 + 7) == 0.0
    data = {
        "wall_s": 100.0,
        "generating_s": 80.0,
        "models": {"policy": {"versions": 500, "train_s": 55.0}},
        "cpu_s": {"raas-0": 84.0, "redis": 11.0},
    }
    assert busy_line(data) == (
        "100.0s, policy 500 steps; busy: generating 80%, training 55%; cpu: raas-0 84%, redis 11%"
    )
    data["redis_commands_per_sample"] = 4.83  # what the launcher's summary adds (the embedded Redis's)
    assert busy_line(data).endswith("cpu: raas-0 84%, redis 11%; redis 4.8 commands/sample")


async def test_eval_results_of_every_policy_reach_the_summary_the_line_and_the_plot(bus, tmp_path):
    """`kind=eval` entries (rows scored together) add up per policy, dataset and version, for a policy
    that is not trained as well."""
    import json

    from astraflow.launch import report
    from astraflow.launch.progress import Progress
    from astraflow.streams.records import EvalResult, encode_record

    def entry(model: str, version: int, rows: int, passed: float) -> dict[str, str]:
        sums = {"pass@1": passed, "mean_reward": passed}
        return encode_record(EvalResult(model, "sums", version, rows, sums, 0))

    progress = Progress(bus, ["policy"], 10)
    for fields in (entry("policy", 0, 4, 1), entry("judge", 0, 4, 2), entry("policy", 2, 3, 2)):
        await bus.redis.xadd(bus.keys.metrics, fields)
    await bus.redis.xadd(bus.keys.metrics, entry("policy", 2, 1, 1))  # the rest of version 2's rows
    snap = await progress.poll()
    assert snap.evals == {"policy": "v2 sums pass@1 0.750", "judge": "v0 sums pass@1 0.500"}
    assert "eval judge v0 sums pass@1 0.500" in line(snap, 10)
    data = report.write(tmp_path, progress, 10, {})
    by_key = {(e["model"], e["version"]): e for e in data["evals"]}
    assert set(by_key) == {("policy", 0), ("judge", 0), ("policy", 2)}
    assert (by_key["policy", 2]["rows"], by_key["policy", 2]["pass@1"]) == (4, 0.75)
    assert json.loads((tmp_path / "summary.json").read_text())["evals"] == data["evals"]
    assert (tmp_path / "reward.png").stat().st_size > 10_000


def test_summary_prices_the_runs_redis_commands_per_trained_sample(bus):
    from astraflow.launch import report
    from astraflow.launch.progress import Progress

    progress = Progress(bus, ["policy"], 10)
    progress.models["policy"].samples = 256  # two steps of 128 samples
    data = report.summary(progress, 10, {"wall_s": 10.0, "redis_commands": 1280})
    assert (data["models"]["policy"]["samples"], data["redis_commands_per_sample"]) == (256, 5.0)
    assert report.busy_line(data).endswith("; redis 5.0 commands/sample")
    assert "redis_commands_per_sample" not in report.summary(progress, 10, {})  # `astraflow record`

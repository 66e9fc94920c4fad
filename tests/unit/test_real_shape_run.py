"""tests/bench/real_shape_run.py reads the per-version time split from what a run leaves (metrics.jsonl,
the trainer's and the RaaS's JSON logs) and notices a worker the launcher had to restart."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "tests" / "bench"))

import real_shape_run


def log(path: Path, *entries: dict) -> None:
    path.write_text("progress bar noise\n" + "".join(json.dumps(e) + "\n" for e in entries))


def at(second: float) -> str:
    return f"2026-12-01T16:56:{second:09.6f}Z"


def test_split_per_version(tmp_path):
    (tmp_path / "logs").mkdir()
    steps = [
        {"version": 1, "wait_s": 99.0, "step_s": 99.0},  # trained, then the trainer was restarted
        {"version": 1, "wait_s": 30.0, "step_s": 12.5},
        {"version": 2, "wait_s": 4.0, "step_s": 11.0},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    log(
        tmp_path / "logs" / "trainer-policy.log",
        {"event": "weights_published", "version": 0, "timestamp": at(1)},
        {"event": "trained", "version": 1, "timestamp": at(2)},
        {"event": "weights_published", "version": 1, "timestamp": at(3)},
        {"event": "trained", "version": 1, "timestamp": at(10)},
        {"event": "weights_published", "version": 1, "timestamp": at(12.5)},
        {"event": "trained", "version": 2, "timestamp": at(30)},
    )
    log(
        tmp_path / "logs" / "raas-0.log",
        {"event": "weights_loaded", "version": 0, "pull_s": 9.0, "load_s": 9.0, "timestamp": at(2)},
        {"event": "weights_loaded", "version": 1, "pull_s": 9.0, "load_s": 9.0, "timestamp": at(4)},
        {"event": "weights_loaded", "version": 1, "pull_s": 0.5, "load_s": 3.0, "timestamp": at(16)},
    )
    rows = real_shape_run.split(tmp_path)
    assert len(rows) == 2  # version 1 once: its last training and what followed it
    assert rows[0] == {
        "version": 1,
        "waited": 30.0,
        "train": 12.5,
        "publish": 2.5,
        "pull": 0.5,
        "load": 3.0,
    }
    # Version 2 was trained but neither published nor loaded before the run stopped: not made up.
    assert rows[1] == {
        "version": 2,
        "waited": 4.0,
        "train": 11.0,
        "publish": None,
        "pull": None,
        "load": None,
    }
    assert real_shape_run.lost_workers(tmp_path, "") == []
    (tmp_path / "logs" / "launcher.log").write_text('{"event": "worker_restarting", "exit": -7}\n')
    assert real_shape_run.lost_workers(tmp_path, "")


def test_the_reward_varies_on_random_output():
    assert real_shape_run.digit_share("", "<|filler_42|>ab") != real_shape_run.digit_share("", "abc") == 0

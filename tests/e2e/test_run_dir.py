"""`astraflow run` never destroys a run directory nor hides a failure: a directory holding files is
refused (they survive), one a live launcher holds is refused with its pid (with --overwrite and --resume
too) until that process ends, and a run whose worker keeps dying exits 1 with the cause on one line."""

import json
import os
import signal
import subprocess
import sys

import pytest
import yaml

from astraflow.launch.run_dir import claim

pytestmark = pytest.mark.e2e
ASTRAFLOW = [sys.executable, "-m", "astraflow.cli", "run"]
HOLDER = """
import sys, time
from pathlib import Path
from astraflow.launch.run_dir import claim
claim(Path(sys.argv[1]), resume=False, overwrite=False)  # what a launcher holds for its life
print("held", flush=True)
time.sleep(120)
"""


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*ASTRAFLOW, *args], capture_output=True, text=True, timeout=300)


def test_a_directory_with_a_users_file_is_refused_and_the_file_kept(tmp_path):
    """Also with --overwrite: the directory holds no run (a mistyped run.dir)."""
    (tmp_path / "notes.txt").write_text("kept")
    refused = run("--set", f"run.dir={tmp_path}")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert refused.stderr == (
        f"astraflow: {tmp_path} holds files but no run (notes.txt; no .astraflow-run): give this run"
        " another directory, or delete them yourself (--set run.dir=DIR)\n"
    )
    assert run("--set", f"run.dir={tmp_path}", "--overwrite").returncode == 1  # not a run's: never emptied
    assert (tmp_path / "notes.txt").read_text() == "kept"


def test_a_live_runs_directory_is_refused_with_its_pid_until_it_ends(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline() == "held\n"
        (tmp_path / "settings.yaml").write_text(yaml.safe_dump({"run": {"name": "held"}}))
        for flags in ([], ["--overwrite"], ["--resume", str(tmp_path)]):
            refused = run("--set", f"run.dir={tmp_path}", *flags)
            assert refused.returncode == 1, refused.stdout + refused.stderr
            assert refused.stderr.startswith(
                f"astraflow: {tmp_path} is in use by a live run (pid {holder.pid})"
            )
            assert refused.stderr.count("\n") == 1
        assert (tmp_path / "settings.yaml").exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    claim(tmp_path, resume=True, overwrite=False).release()  # the kernel dropped the dead holder's lock


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_whose_worker_keeps_dying_exits_1_with_the_cause(tmp_path, tiny_model):
    """The dataflow dies at start on a dataset row that is not JSON (a path that does not exist is
    refused before anything starts); the run stops at once (no restart allowed), reports, exits 1."""
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1="}\nnot json\n')
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "run": {"name": "failing", "max_restarts": 0, "target_reward": None, "max_time_s": 200},
                "engine": {"type": "hf", "model": tiny_model},
                "dataflow": {"dataset": {"type": "jsonl", "path": str(data)}},
            }
        )
    )
    run_dir = tmp_path / "run"
    failed = run(str(recipe), "--set", f"run.dir={run_dir}")
    assert failed.returncode == 1, failed.stdout[-3000:] + failed.stderr[-3000:]
    error = f"ValueError: {data}:2: not JSON (Expecting value)"
    log = run_dir / "logs" / "dataflow.log"
    assert failed.stderr.splitlines()[-1] == (
        f"astraflow: run failed: dataflow died once in 600s (last exit 1): {error}; see {log}"
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit_status"] == 1 and summary["failed"] == {"worker": "dataflow", "error": error}
    assert summary["stopped"].startswith("dataflow died once"), summary
    again = run(str(recipe), "--set", f"run.dir={run_dir}")  # what it left is not overwritten unasked
    assert again.returncode == 1 and "holds a run" in again.stderr, again.stderr
    assert os.path.exists(run_dir / "summary.json")

"""`astraflow run` never destroys a run directory: a directory holding files is refused (they survive),
one a live launcher holds is refused with its pid (with --overwrite and --resume too) until that process
ends."""

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
    (tmp_path / "notes.txt").write_text("kept")
    refused = run("--set", f"run.dir={tmp_path}")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert refused.stderr == (
        f"astraflow: {tmp_path} is not empty (notes.txt): continue its run with --resume {tmp_path},"
        " replace what it holds with --overwrite, or give this run another directory (--set run.dir=DIR)\n"
    )
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

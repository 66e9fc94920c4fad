"""A run directory is taken only when empty, resumed or overwritten (a run's, never any other), and never
while a launcher holds it; an overwrite keeps the lock file (a second launcher must find the same lock),
and refuses a directory astraflow did not mark, one holding a git repository or a live run's directory,
directly or through a link, and a run name that names a directory around the run's."""

import os
import subprocess
import sys

import pytest
from pydantic import ValidationError

from astraflow.config import RunSettings
from astraflow.errors import RunDirError
from astraflow.launch.run_dir import LOCK, MARK, claim

HOLDER = """
import sys, time
from pathlib import Path
from astraflow.launch.run_dir import claim
claim(Path(sys.argv[1]), resume=False, overwrite=False)  # what a launcher holds for its life
print("held", flush=True)
time.sleep(120)
"""


def a_run(path, name="earlier"):
    """A directory as a launcher leaves it: marked, its settings and logs."""
    path.mkdir(parents=True, exist_ok=True)
    held = claim(path, resume=True, overwrite=False)
    held.mark(name)
    (path / "settings.yaml").write_text(f"run: {{name: {name}}}\n")
    (path / "logs").mkdir()
    held.release()
    return path


@pytest.fixture
def live_run(tmp_path):
    """A run directory a live launcher (another process) holds."""
    path = tmp_path / "outer" / "live"
    path.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        (path / "settings.yaml").write_text("run: {name: live}\n")
        yield path
    finally:
        holder.kill()
        holder.wait()


def test_an_empty_or_missing_directory_is_taken(tmp_path):
    held = claim(tmp_path / "run", resume=False, overwrite=False)
    assert (tmp_path / "run" / LOCK).read_text() == f"{os.getpid()}\n"
    held.release()
    claim(tmp_path / "run", resume=False, overwrite=False).release()  # the lock alone is no content


def test_files_that_are_no_run_are_never_taken(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    for overwrite in (False, True):  # a mistyped run.dir (a home, a repository) is never emptied
        with pytest.raises(RunDirError, match=r"holds files but no run \(notes\.txt; no \.astraflow-run\)"):
            claim(tmp_path, resume=False, overwrite=overwrite)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_a_run_is_refused_unless_resumed_or_overwritten(tmp_path):
    a_run(tmp_path)
    with pytest.raises(RunDirError, match=r"holds a run \(\.astraflow-run, logs, settings\.yaml\): continue"):
        claim(tmp_path, resume=False, overwrite=False)
    claim(tmp_path, resume=True, overwrite=False).release()
    held = claim(tmp_path, resume=False, overwrite=True)
    assert (tmp_path / "logs").exists()  # nothing deleted until the launcher is sure to start
    held.clear()
    assert [p.name for p in tmp_path.iterdir()] == [LOCK]
    held.mark("later")
    held.release()
    assert claim(tmp_path, resume=False, overwrite=True).contents() == [tmp_path / MARK]  # `make run` twice


def repository(path):
    """The attack's victim: a git repository that happens to hold a settings.yaml."""
    (path / "src").mkdir(parents=True)
    (path / "src" / "code.py").write_text("print('mine')\n")
    (path / "settings.yaml").write_text("run: {name: mine}\n")
    subprocess.run(["git", "init", "-q", str(path)], check=True)
    return path


@pytest.mark.parametrize("through_link", [False, True], ids=["direct", "link"])
def test_overwrite_never_takes_a_git_repository(tmp_path, through_link):
    repo = repository(tmp_path / "repo")
    target = tmp_path / "link" if through_link else repo
    if through_link:
        target.symlink_to(repo)
    with pytest.raises(RunDirError, match=r"holds files but no run \(\.git, settings\.yaml, src; no"):
        claim(target, resume=False, overwrite=True)
    marked = claim(repo, resume=True, overwrite=False)  # marked too (a run directory later put under git)
    marked.mark("once")
    marked.release()
    with pytest.raises(RunDirError, match=r"holds a git repository \(.*repo/\.git\): --overwrite deletes"):
        claim(target, resume=False, overwrite=True)  # marked too: still never emptied
    assert (repo / ".git" / "HEAD").exists() and (repo / "src" / "code.py").exists()


def test_overwrite_never_takes_a_directory_holding_a_live_run(tmp_path, live_run):
    outer = live_run.parent
    a_run(outer)  # an earlier run in the directory around the live one
    with pytest.raises(RunDirError, match=rf"holds {live_run}, the directory of a live run"):
        claim(outer, resume=False, overwrite=True)
    (tmp_path / "link").symlink_to(outer)
    with pytest.raises(RunDirError, match=rf"holds {live_run}, the directory of a live run"):
        claim(tmp_path / "link", resume=False, overwrite=True)
    elsewhere = a_run(tmp_path / "elsewhere")
    (elsewhere / "logs" / "live").symlink_to(live_run, target_is_directory=True)
    with pytest.raises(RunDirError, match=rf"holds a link to {live_run}, the directory of a live run"):
        claim(elsewhere, resume=False, overwrite=True)
    assert (live_run / "settings.yaml").exists()


def test_overwrite_never_takes_a_directory_inside_a_live_run(live_run):
    inner = a_run(live_run / "logs" / "sub")
    with pytest.raises(RunDirError, match=rf"lies inside {live_run}, the directory of a live run"):
        claim(inner, resume=False, overwrite=True)


@pytest.mark.parametrize("name", ["..", ".", "...", "a/b", "", "../x"])
def test_a_run_name_that_is_no_plain_name_is_refused(name):
    with pytest.raises(ValidationError, match=r"run\.name|name"):
        RunSettings(name=name)
    assert RunSettings(name="a.b-c_1").path.name == "a.b-c_1"


@pytest.mark.parametrize("flags", [{}, {"resume": True}, {"overwrite": True}], ids=str)
def test_a_held_directory_is_refused_with_the_holders_pid(tmp_path, flags):
    held = claim(tmp_path, resume=False, overwrite=False)
    held.mark("live")
    with pytest.raises(RunDirError, match=rf"is in use by a live run \(pid {os.getpid()}\)"):
        claim(tmp_path, **{"resume": False, "overwrite": False, **flags})
    held.release()
    assert (tmp_path / MARK).exists()

"""A run directory is taken only when empty, resumed or overwritten (a run's, never any other), and never
while a launcher holds it; an overwrite keeps the lock file (a second launcher must find the same lock)."""

import os

import pytest

from astraflow.errors import RunDirError
from astraflow.launch.run_dir import LOCK, claim


def test_an_empty_or_missing_directory_is_taken(tmp_path):
    held = claim(tmp_path / "run", resume=False, overwrite=False)
    assert (tmp_path / "run" / LOCK).read_text() == f"{os.getpid()}\n"
    held.release()
    claim(tmp_path / "run", resume=False, overwrite=False).release()  # the lock alone is no content


def test_files_that_are_no_run_are_never_taken(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    for overwrite in (False, True):  # a mistyped run.dir (a home, a repository) is never emptied
        with pytest.raises(RunDirError, match=r"holds files but no run \(notes\.txt; no settings\.yaml\)"):
            claim(tmp_path, resume=False, overwrite=overwrite)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_a_run_is_refused_unless_resumed_or_overwritten(tmp_path):
    (tmp_path / "settings.yaml").write_text("run: {name: earlier}\n")
    (tmp_path / "logs").mkdir()
    with pytest.raises(RunDirError, match=r"holds a run \(logs, settings\.yaml\): continue it with --resume"):
        claim(tmp_path, resume=False, overwrite=False)
    claim(tmp_path, resume=True, overwrite=False).release()
    held = claim(tmp_path, resume=False, overwrite=True)
    assert (tmp_path / "logs").exists()  # nothing deleted until the launcher is sure to start
    held.clear()
    assert [p.name for p in tmp_path.iterdir()] == [LOCK]
    held.release()


@pytest.mark.parametrize("flags", [{}, {"resume": True}, {"overwrite": True}], ids=str)
def test_a_held_directory_is_refused_with_the_holders_pid(tmp_path, flags):
    held = claim(tmp_path, resume=False, overwrite=False)
    (tmp_path / "settings.yaml").write_text("run: {name: live}\n")
    with pytest.raises(RunDirError, match=rf"is in use by a live run \(pid {os.getpid()}\)"):
        claim(tmp_path, **{"resume": False, "overwrite": False, **flags})
    held.release()
    assert (tmp_path / "settings.yaml").exists()

"""A run directory is taken only when empty, resumed or overwritten, and never while a launcher holds it;
an overwrite keeps the lock file (a second launcher must find the same lock)."""

import os

import pytest

from astraflow.errors import RunDirError
from astraflow.launch.run_dir import LOCK, claim


def test_an_empty_or_missing_directory_is_taken(tmp_path):
    held = claim(tmp_path / "run", resume=False, overwrite=False)
    assert (tmp_path / "run" / LOCK).read_text() == f"{os.getpid()}\n"
    held.release()
    claim(tmp_path / "run", resume=False, overwrite=False).release()  # the lock alone is no content


def test_a_directory_with_files_is_refused_unless_resumed_or_overwritten(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(RunDirError, match=r"is not empty \(notes\.txt\): continue its run with --resume"):
        claim(tmp_path, resume=False, overwrite=False)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    claim(tmp_path, resume=True, overwrite=False).release()
    assert (tmp_path / "notes.txt").exists()
    held = claim(tmp_path, resume=False, overwrite=True)
    assert (tmp_path / "notes.txt").exists()  # nothing deleted until the launcher is sure to start
    (tmp_path / "logs").mkdir()
    held.clear()
    assert [p.name for p in tmp_path.iterdir()] == [LOCK]
    held.release()


@pytest.mark.parametrize("flags", [{}, {"resume": True}, {"overwrite": True}], ids=str)
def test_a_held_directory_is_refused_with_the_holders_pid(tmp_path, flags):
    held = claim(tmp_path, resume=False, overwrite=False)
    (tmp_path / "summary.json").write_text("{}")
    with pytest.raises(RunDirError, match=rf"is in use by a live run \(pid {os.getpid()}\)"):
        claim(tmp_path, **{"resume": False, "overwrite": False, **flags})
    held.release()
    assert (tmp_path / "summary.json").exists()

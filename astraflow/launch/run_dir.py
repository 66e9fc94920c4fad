"""A run directory is never destroyed by accident: `astraflow run` takes it only when it is empty, asked to
`--resume` the run in it, or told to `--overwrite` it, and never while another launcher holds it.

The holder is the launcher that `claim`ed it: an exclusive `flock` on `.lock` in the directory, held for
the launcher's life (the kernel drops it when the process ends, however it ends), the file naming its
pid for whoever is refused.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

from astraflow.errors import RunDirError

LOCK = ".lock"
RUN_MARK = "settings.yaml"
"""What every launcher writes into its run directory first: `--overwrite` replaces only a directory that
has it (a mistyped run.dir, a home or a repository, is never emptied)."""


class Claim:
    """The held lock of a run directory (released by `release`, or by the end of the process)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self.fd = path, fd

    def contents(self) -> list[Path]:
        """What the directory holds besides the lock."""
        return sorted(p for p in self.path.iterdir() if p.name != LOCK)

    def clear(self) -> None:
        """Delete everything but the lock (deleting the lock file would let a second launcher lock a new
        one beside this one)."""
        for p in self.contents():
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # (the lock goes with the descriptor)
            self.fd = -1


def claim(path: Path, *, resume: bool, overwrite: bool) -> Claim:
    """Lock run directory `path` (made if missing) for this process. Raises RunDirError when a live
    process holds it (naming its pid: with `--resume` and `--overwrite` too), or when it holds anything
    and this is no resume: files but no run (RUN_MARK), or a run and this is no overwrite. Deletes
    nothing: the caller `clear`s it when it is sure to start."""
    path.mkdir(parents=True, exist_ok=True)
    fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RunDirError(
            f"{path} is in use by a live run (pid {holder}): stop it first, or give this run another"
            " directory (--set run.dir=DIR)"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    held = Claim(path, fd)
    found = held.contents()
    if found and not resume:
        shown = ", ".join(p.name for p in found[:3]) + (", ..." if len(found) > 3 else "")
        problem = None
        if not (path / RUN_MARK).exists():
            problem = f"holds files but no run ({shown}; no {RUN_MARK}): give this run another directory"
        elif not overwrite:
            problem = (
                f"holds a run ({shown}): continue it with --resume {path}, replace it with --overwrite, or"
                " give this run another directory"
            )
        if problem is not None:
            held.release()
            raise RunDirError(f"{path} {problem} (--set run.dir=DIR)")
    return held

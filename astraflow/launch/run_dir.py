"""A run directory is never destroyed by accident: `astraflow run` takes it only when it is empty, asked to
`--resume` the run in it, or told to `--overwrite` it, and never while another launcher holds it.

The holder is the launcher that `claim`ed it: an exclusive `flock` on `.lock` in the directory, held for
the launcher's life (the kernel drops it when the process ends, however it ends), the file naming its
pid for whoever is refused. The launcher then `mark`s it (MARK: the run's name and id), and `--overwrite`
deletes only a directory that carries that mark, holds no `.git` anywhere, and holds no directory a live
launcher holds, nor lies inside one (`unsafe`).
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import shutil
from pathlib import Path

from astraflow.errors import RunDirError

LOCK = ".lock"
MARK = ".astraflow-run"
"""What every launcher writes into its run directory first, `{"name": ..., "id": ...}`: `--overwrite`
replaces only a directory that has it (a mistyped run.dir, a home or a repository, is never emptied)."""
MARK_MAX_BYTES = 4096


def read_mark(path: Path) -> dict[str, str] | None:
    """The mark of run directory `path` (name and id, both strings), or None when it has none or the file
    is not one astraflow wrote (a directory or link by that name, too large, not that JSON)."""
    f = path / MARK
    if f.is_symlink() or not f.is_file() or f.stat().st_size > MARK_MAX_BYTES:
        return None
    try:
        data = json.loads(f.read_bytes())
    except ValueError:
        return None
    if not isinstance(data, dict) or not all(isinstance(data.get(k), str) for k in ("name", "id")):
        return None
    return {"name": data["name"], "id": data["id"]}


def held_by_live_launcher(lock: Path) -> bool:
    """Whether a live process holds the run lock file `lock` (probed with a shared lock, let go at once)."""
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def live_run_at(path: Path) -> Path | None:
    """The directory of a live run that is `path` or holds it, if any."""
    return next((p for p in (path, *path.parents) if held_by_live_launcher(p / LOCK)), None)


def unsafe(path: Path) -> str | None:
    """Why deleting what run directory `path` holds would destroy what is not a run's (None when it would
    not): a `.git` anywhere in it (a repository or a worktree), a directory a live launcher holds, in it
    or around it, or a link in it to one. The walk follows no link (deleting one removes the link, not its
    target), and `path` itself is its resolved form: the lock of its own launcher is skipped."""
    own = path / LOCK
    if (live := live_run_at(path.parent)) is not None:
        return f"lies inside {live}, the directory of a live run"
    for root, dirs, files in os.walk(path, followlinks=False):
        here = Path(root)
        if ".git" in dirs or ".git" in files:
            return f"holds a git repository ({here / '.git'})"
        if LOCK in files and here / LOCK != own and held_by_live_launcher(here / LOCK):
            return f"holds {here}, the directory of a live run"
        for name in dirs:
            if (here / name).is_symlink() and (live := live_run_at((here / name).resolve())) is not None:
                return f"holds a link to {live}, the directory of a live run ({here / name})"
    return None


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

    def mark(self, name: str) -> dict[str, str]:
        """Write MARK for run `name`, keeping the id of a mark the directory already has (a resumed run);
        returns the mark."""
        found = read_mark(self.path)
        mark = {"name": name, "id": found["id"] if found else secrets.token_hex(8)}
        tmp = self.path / f"{MARK}.tmp"
        tmp.write_text(json.dumps(mark) + "\n")
        tmp.replace(self.path / MARK)
        return mark

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # (the lock goes with the descriptor)
            self.fd = -1


def claim(path: Path, *, resume: bool, overwrite: bool) -> Claim:
    """Lock run directory `path` (made if missing; a link is followed: the directory it names is the run
    directory) for this process. Raises RunDirError when a live process holds it (naming its pid: with
    `--resume` and `--overwrite` too), or when it holds anything and this is no resume: files but no run
    (no MARK), a run and this is no overwrite, or a run whose deletion would reach what is no run's
    (`unsafe`). Deletes nothing: the caller `clear`s it when it is sure to start."""
    path.mkdir(parents=True, exist_ok=True)
    path = path.resolve()
    fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
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
        if read_mark(path) is None:
            problem = (
                f"holds files but no run ({shown}; no {MARK}): give this run another directory, or delete"
                " them yourself"
            )
        elif not overwrite:
            problem = (
                f"holds a run ({shown}): continue it with --resume {path}, replace it with --overwrite, or"
                " give this run another directory"
            )
        elif (why := unsafe(path)) is not None:
            problem = f"{why}: --overwrite deletes only a run's files; give this run another directory"
        if problem is not None:
            held.release()
            raise RunDirError(f"{path} {problem} (--set run.dir=DIR)")
    return held

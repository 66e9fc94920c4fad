"""Namespaces for tool calls: each call runs as an unprivileged uid of its own in fresh PID, mount, network,
IPC and UTS namespaces, under a root filesystem that holds only the system's programs and the interpreter
(read-only), a fresh `/tmp` and `/dev/shm`, a minimal `/dev`, its own `/proc` and its scratch directory.

Built from util-linux (`unshare`, `setpriv`, `mount`) and coreutils' `chroot`: nothing to install. It needs
the rights to create those namespaces (root, or CAP_SYS_ADMIN and CAP_SETUID); one probe per process
tells whether this machine grants them (`available`).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

TOOL_UID_BASE = 1_000_000_000
"""Tool calls run as uids from here up, one per concurrent call on the host (no user of the machine has
them), so one call's processes count against its own RLIMIT_NPROC and no other call's files are its own."""
UID_LOCK_DIR = Path(tempfile.gettempdir()) / "astraflow-tool-uids"
"""Lock files of the tool uids in use on this host: a call holds an flock on `<uid>`, so two processes
(two RaaS workers, a reward pool) never run calls as the same uid; the kernel drops it if the process dies."""
TMPFS_SIZE = "64m"
"""Size of the tool's fresh `/tmp` and `/dev/shm` (their pages are memory that RLIMIT_AS does not count)."""
WORKDIR = "/sandbox"
"""Where the tool's root shows its scratch directory (its cwd)."""
_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
_DEVICES = ("null", "zero", "random", "urandom")
_held: dict[int, int] = {}
"""Tool uid -> the descriptor of its lock file, for the uids this process holds."""
_lock = threading.Lock()


def take_uid() -> int:
    """The lowest tool uid no running call on this host holds (in any process); hand it back with
    `release_uid`."""
    UID_LOCK_DIR.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(PermissionError):  # (another user's directory: already shared)
        UID_LOCK_DIR.chmod(0o1777)
    with _lock:
        uid = TOOL_UID_BASE
        while True:
            if uid not in _held:
                fd = os.open(UID_LOCK_DIR / str(uid), os.O_CREAT | os.O_RDWR, 0o666)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                else:
                    _held[uid] = fd
                    return uid
            uid += 1


def release_uid(uid: int) -> None:
    with _lock:
        fd = _held.pop(uid, None)
    if fd is not None:
        os.close(fd)  # (drops the lock; the file stays, for the next call to lock)


def _readable_trees() -> list[str]:
    """What the tool's root shows read-only: the system's programs and the interpreter with its packages."""
    trees = ["/usr"]
    for prefix in (sys.base_prefix, sys.prefix):
        real = os.path.realpath(prefix)
        if not any(real == t or real.startswith(t + "/") for t in trees):
            trees.append(real)
    return trees


def _setup_script(root: Path, workdir: Path, uid: int, argv: Sequence[str]) -> str:
    """The shell that runs as root inside the new namespaces: build the tool's root, then drop to `uid`
    (no groups, no capabilities, no new privileges) and run `argv` in it. `set -e`: any step failing
    stops the call before the tool runs."""
    q = shlex.quote
    r = q(str(root))
    trees, links = list(_readable_trees()), []
    for top in ("/bin", "/lib", "/lib64", "/sbin"):  # merged-/usr links, or directories of their own
        if os.path.islink(top):
            links.append(f"ln -s {q(os.readlink(top))} {r}{top}")
        elif os.path.isdir(top):
            trees.append(top)
    dirs = [*trees, "/proc", WORKDIR]
    # Few commands: each is a process started on every tool call. The fresh /tmp and /dev/shm first: a
    # tree that lives under one of them (an environment in /tmp) is then bound on top, not hidden.
    lines = [
        "set -e",
        f"mount -t tmpfs -o mode=755,size=1m tool-root {r}",
        f"mkdir -p {r}/dev/shm {r}/tmp",
        f"mount -t tmpfs -o nosuid,nodev,mode=1777,size={TMPFS_SIZE} tool-shm {r}/dev/shm",
        f"mount -t tmpfs -o nosuid,nodev,mode=1777,size={TMPFS_SIZE} tool-tmp {r}/tmp",
        "mkdir -p " + " ".join(r + q(d) for d in dirs),
        "touch " + " ".join(f"{r}/dev/{d}" for d in _DEVICES),
        *links,
        *(f"mount --bind -o ro {q(t)} {r}{q(t)}" for t in trees),
        f"mount -t proc -o nosuid,nodev,noexec proc {r}/proc",  # this PID namespace's processes only
        *(f"mount --bind /dev/{d} {r}/dev/{d}" for d in _DEVICES),
        f"mount --bind {q(str(workdir))} {r}{WORKDIR}",
        f"mount -o remount,ro {r}",
        # Not exec'd: this shell stays the namespace's first process, so the tool is not (the kernel
        # shields a first process from its own signals, SIGXCPU and SIGXFSZ among them), and a tool
        # ended by a signal exits with 128 + its number (`exit_status`).
        "set +e",
        f"chroot {r} setpriv --reuid={uid} --regid={uid} --clear-groups --no-new-privs "
        f"--inh-caps=-all --bounding-set=-all -- {shlex.join(argv)}",
        'exit "$?"',
    ]
    return "\n".join(lines)


def command(scratch: Path, workdir: Path, uid: int, argv: Sequence[str]) -> list[str]:
    """The command that runs `argv` isolated, with `workdir` as its WORKDIR (`scratch` holds the root's
    mount point). Ending it ends every process the tool started: they live in its PID namespace, whose
    first process dies with `unshare` (--kill-child) and takes the rest with it; `unshare` dies with the
    thread that started it."""
    root = scratch / "root"
    root.mkdir()
    return [
        "setpriv",
        "--pdeathsig=KILL",  # a worker that dies (kill -9 too) takes its tools' namespaces with it
        "--",
        "unshare",
        "--pid",
        "--fork",
        "--kill-child",
        "--mount",
        "--net",
        "--ipc",
        "--uts",
        "--",
        "sh",
        "-c",
        _setup_script(root, workdir, uid, argv),
    ]


def exit_status(returncode: int) -> int:
    """An isolated call's status as a plain one's: -N when the tool was ended by signal N."""
    return -(returncode - 128) if returncode > 128 else returncode


def interpreter() -> str:
    """This interpreter by a path the tool's root shows (its environment's directory, links resolved)."""
    return os.path.join(os.path.realpath(os.path.dirname(sys.executable)), os.path.basename(sys.executable))


ENV = {"PATH": _PATH}
"""The environment of an isolated call, its setup and the tool: a search path, nothing else."""


@functools.cache
def available() -> str | None:
    """None when tool calls can be isolated here, else why not (probed once per process: a trivial call
    through the same command)."""
    missing = [p for p in ("unshare", "setpriv", "chroot", "mount") if shutil.which(p, path=_PATH) is None]
    if missing:
        return f"not found: {', '.join(missing)}"
    import tempfile

    with tempfile.TemporaryDirectory(prefix="astraflow-probe-") as scratch:
        work = Path(scratch) / "work"
        work.mkdir()
        argv = command(Path(scratch), work, TOOL_UID_BASE, [interpreter(), "-I", "-c", "pass"])
        try:
            done = subprocess.run(argv, env=ENV, capture_output=True, timeout=30, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as e:
            return repr(e)
    if done.returncode != 0:
        lines = done.stderr.decode(errors="replace").strip().splitlines()
        return lines[-1] if lines else f"exit {done.returncode}"
    return None

"""Namespaces for tool calls: each call runs in fresh PID, mount, network, IPC and UTS namespaces, under a
root filesystem that holds only the system's programs and the interpreter (read-only), a minimal `/dev`,
its own `/proc`, and one size-capped tmpfs (`disk_mb`) behind its only writable places: `/sandbox` (its
cwd), `/tmp` and `/dev/shm`. What it writes never reaches the host's disk, and no more than `disk_mb`.

Two ways in, probed once per process (`mode`):
- `root-namespaces` (the worker is root): the call runs as an unprivileged uid of its own (`take_uid`);
- `user-namespaces` (any user, where the kernel allows unprivileged user namespaces): a user namespace
  maps the worker's uid to root inside it, the setup runs as that root, and the tool runs as it with
  every capability dropped for good (empty bounding, inheritable and ambient sets, locked `noroot`
  securebits, no new privileges); it cannot make another user namespace (the kernel refuses one to a
  chrooted process), so it cannot get capabilities back.
Elsewhere (`none`) `sandbox` runs tools as the worker's user in a process group.

Built from util-linux (`unshare`, `setpriv`, `mount`) and coreutils' `chroot`: nothing to install.
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
from dataclasses import dataclass
from pathlib import Path

TOOL_UID_BASE = 1_000_000_000
"""Tool calls run as uids from here up, one per concurrent call on the host (no user of the machine has
them), so one call's processes count against its own RLIMIT_NPROC and no other call's files are its own."""
UID_LOCK_DIR = Path(tempfile.gettempdir()) / "astraflow-tool-uids"
"""Lock files of the tool uids in use on this host: a call holds an flock on `<uid>`, so two processes
(two RaaS workers, a reward pool) never run calls as the same uid; the kernel drops it if the process dies."""
WORKDIR = "/sandbox"
"""Where the tool's root shows its scratch directory (its cwd)."""
DISK_MB = 64
"""Default size of the tmpfs behind the tool's `/sandbox`, `/tmp` and `/dev/shm` together (its pages are
memory that RLIMIT_AS does not count)."""
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


def _setup_script(
    root: Path,
    rw: Path,
    uid: int | None,
    disk_mb: int,
    argv: Sequence[str],
    shown: Sequence[str] = (),
    before: Sequence[str] = (),
) -> str:
    """The shell that runs as root inside the new namespaces: build the tool's root, run the `before`
    lines, then run `argv` in the root as `uid` (None: as the user namespace's root, capabilities
    dropped), no groups, no new privileges. `set -e`: any step failing stops the call before the tool
    runs."""
    q = shlex.quote
    r, w = q(str(root)), q(str(rw))
    trees, links = [*_readable_trees(), *(os.path.realpath(t) for t in shown)], []
    for top in ("/bin", "/lib", "/lib64", "/sbin"):  # merged-/usr links, or directories of their own
        if os.path.islink(top):
            links.append(f"ln -s {q(os.readlink(top))} {r}{top}")
        elif os.path.isdir(top):
            trees.append(top)
    dirs = ["/proc", "/tmp", "/dev/shm", WORKDIR]
    owner = f"chown {uid}:{uid} {w}/work" if uid is not None else ":"  # userns: its root is the tool
    if uid is None:  # stays root of its user namespace: no capability, none regained by exec; its
        # groups cannot change there (setgroups is denied), and its root shows no file they would open
        drop = "--ambient-caps=-all --securebits=+noroot,+noroot_locked,+no_setuid_fixup,+keep_caps_locked"
    else:
        drop = f"--reuid={uid} --regid={uid} --clear-groups"
    # Few commands: each is a process started on every tool call. One tmpfs holds everything the tool can
    # write, so `disk_mb` caps it all; it is mounted outside the tool's root, which shows three of its
    # directories. /proc: a container whose /proc is masked refuses a fresh one (the tool goes without).
    # The read-only trees go last, over the writable places: an interpreter under /tmp (a virtual
    # environment there) stays visible at its own path, its mount point a directory of the tool's /tmp.
    lines = [
        "set -e",
        f"mount -t tmpfs -o mode=755,size=1m tool-root {r}",
        f"mount -t tmpfs -o nosuid,nodev,mode=755,size={disk_mb}m tool-rw {w}",
        f"mkdir -p {w}/work {w}/tmp {w}/shm",
        f"chmod 1777 {w}/tmp {w}/shm",
        owner,
        "mkdir -p " + " ".join(r + q(d) for d in dirs),
        "touch " + " ".join(f"{r}/dev/{d}" for d in _DEVICES),
        *links,
        f"mount -t proc -o nosuid,nodev,noexec proc {r}/proc || :",  # this PID namespace's processes only
        *(f"mount --bind /dev/{d} {r}/dev/{d}" for d in _DEVICES),
        f"mount --bind {w}/work {r}{WORKDIR}",
        f"mount --bind {w}/tmp {r}/tmp",
        f"mount --bind {w}/shm {r}/dev/shm",
        "mkdir -p " + " ".join(r + q(t) for t in trees),
        *(f"mount --bind -o ro {q(t)} {r}{q(t)}" for t in trees),
        f"mount -o remount,bind,ro {r}",
        *before,
        # Not exec'd: this shell stays the namespace's first process, so the tool is not (the kernel
        # shields a first process from its own signals, SIGXCPU and SIGXFSZ among them), and a tool
        # ended by a signal exits with 128 + its number (`exit_status`).
        "set +e",
        "unset PWD OLDPWD",  # the worker's cwd: the tool's environment is ENV alone
        f"chroot {r} setpriv {drop} --no-new-privs --inh-caps=-all --bounding-set=-all -- {shlex.join(argv)}",
        'exit "$?"',
    ]
    return "\n".join(lines)


def command(
    scratch: Path,
    uid: int | None,
    argv: Sequence[str],
    disk_mb: int = DISK_MB,
    shown: Sequence[str] = (),
    before: Sequence[str] = (),
) -> list[str]:
    """The command that runs `argv` isolated (`scratch` holds the mount points of its root and of its
    writable tmpfs). `uid`: the call's uid (root-namespaces), or None to run in a user namespace of its
    own as the worker's user (user-namespaces). `shown`: directories its root shows too, read-only;
    `before`: shell lines run in its namespaces, as their root, just before it starts. Ending it ends
    every process the tool started: they live in its PID namespace, whose first process dies with
    `unshare` (--kill-child) and takes the rest with it; `unshare` dies with the thread that started it."""
    root, rw = scratch / "root", scratch / "rw"
    root.mkdir()
    rw.mkdir()
    user = ["--user", "--map-root-user"] if uid is None else []
    return [
        "setpriv",
        "--pdeathsig=KILL",  # a worker that dies (kill -9 too) takes its tools' namespaces with it
        "--",
        "unshare",
        *user,
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
        _setup_script(root, rw, uid, disk_mb, argv, shown, before),
    ]


def exit_status(returncode: int) -> int:
    """An isolated call's status as a plain one's: -N when the tool was ended by signal N."""
    return -(returncode - 128) if returncode > 128 else returncode


def interpreter() -> str:
    """This interpreter by a path the tool's root shows (its environment's directory, links resolved)."""
    return os.path.join(os.path.realpath(os.path.dirname(sys.executable)), os.path.basename(sys.executable))


ENV = {"PATH": _PATH}
"""The environment of an isolated call, its setup and the tool: a search path, nothing else."""

ROOT, USER, NONE = "root-namespaces", "user-namespaces", "none"


@dataclass(frozen=True)
class Mode:
    """How this machine isolates tool calls (`mode`)."""

    name: str
    """ROOT, USER or NONE."""
    reason: str | None = None
    """Why neither namespace mode works here (NONE), else None."""

    def describe(self) -> str:
        """One line for `astraflow health`: the mode and what bounds a call's memory."""
        if self.name == NONE:
            return f"{NONE} (tools run as the worker's user, unisolated: {self.reason})"
        return f"{self.name} (memory: RLIMIT_AS per process and a process count per call; disk: tmpfs)"


@functools.cache
def mode() -> Mode:
    """The mode tool calls run in here, probed once per process: a trivial call through each command
    (as root, root-namespaces first)."""
    missing = [p for p in ("unshare", "setpriv", "chroot", "mount") if shutil.which(p, path=_PATH) is None]
    if missing:
        return Mode(NONE, f"not found: {', '.join(missing)}")
    tried = [(ROOT, TOOL_UID_BASE)] if os.geteuid() == 0 else []
    reasons = []
    for name, uid in [*tried, (USER, None)]:
        why = _probe(uid)
        if why is None:
            return Mode(name)
        reasons.append(f"{name}: {why}")
    return Mode(NONE, "; ".join(reasons))


def available() -> str | None:
    """None when tool calls can be isolated in namespaces here, else why not."""
    return mode().reason


def _probe(uid: int | None) -> str | None:
    with tempfile.TemporaryDirectory(prefix="astraflow-probe-") as scratch:
        argv = command(Path(scratch), uid, [interpreter(), "-I", "-c", "pass"], disk_mb=1)
        try:
            done = subprocess.run(argv, env=ENV, capture_output=True, timeout=30, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as e:
            return repr(e)
    if done.returncode != 0:
        lines = done.stderr.decode(errors="replace").strip().splitlines()
        return lines[-1] if lines else f"exit {done.returncode}"
    return None

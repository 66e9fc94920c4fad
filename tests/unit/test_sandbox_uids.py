"""Sandbox uids are unique per host, not per process (issue 20, item 12)."""

from __future__ import annotations

import subprocess
import sys

from astraflow.workflows import isolation

HOLD_A_UID = """
import sys
from astraflow.workflows import isolation
print(isolation.take_uid(), flush=True)
sys.stdin.read()
"""


def test_two_processes_never_get_the_same_sandbox_uid():
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD_A_UID], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        theirs = int(child.stdout.readline())
        mine = isolation.take_uid()
        try:
            assert mine != theirs
        finally:
            isolation.release_uid(mine)
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    again = isolation.take_uid()  # the child is gone: its uid is free again
    isolation.release_uid(again)
    assert again <= theirs

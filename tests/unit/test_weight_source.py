"""A source still being received (a relay) serves each range as it arrives, also one past a gap: a
receiver pulling in parallel ranges from a relay that pulls in parallel ranges gets bytes at once."""

import threading

import pytest

from astraflow.weights.transport import Source
from astraflow.weights.wire import TransferError


def test_bytes_past_a_gap_are_served_as_they_arrive():
    src = Source(0, 0, 100, complete=False)
    src.arrived(50, 60)
    src.arrived(60, 70)
    assert src.wait_past(50, 0.1) == 70  # the second range of a parallel pull, before the first arrived
    with pytest.raises(TransferError, match="stalled"):
        src.wait_past(0, 0.05)
    src.arrived(0, 50)
    assert src.wait_past(0, 0.1) == 70


def test_a_waiting_transfer_wakes_on_arrival_and_on_failure():
    src = Source(0, 0, 100, complete=False)
    threading.Timer(0.05, src.arrived, (0, 30)).start()
    assert src.wait_past(0, 5) == 30
    threading.Timer(0.05, src.fail).start()
    with pytest.raises(TransferError, match="failed"):
        src.wait_past(30, 5)

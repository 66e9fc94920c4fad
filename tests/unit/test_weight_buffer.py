"""The double buffer's writer never waits for ever: transfers reading the half it needs are cut off,
and a reader that cannot be cut fails the write instead of blocking it."""

import threading

import pytest

from astraflow.messages import TensorSpec
from astraflow.weights.buffer import DoubleBuffer
from astraflow.weights.wire import TransferError

SPECS = [TensorSpec(name="w", dtype="bfloat16", shape=[8], offset=0, nbytes=16)]


def test_a_transfer_reading_the_half_to_write_is_cut_off(tmp_path):
    buffer = DoubleBuffer(tmp_path, SPECS, grace_s=0.05)
    release = threading.Event()
    held = threading.Event()

    def transfer() -> None:  # holds the idle half until cut off
        with buffer.reading(buffer.idle, cut=release.set):
            held.set()
            release.wait(30)

    reader = threading.Thread(target=transfer)
    reader.start()
    held.wait(30)
    half = buffer.claim()
    assert release.is_set() and not half.readers
    reader.join()
    buffer.close()


def test_a_reader_that_cannot_be_cut_fails_the_write_instead_of_blocking_it(tmp_path):
    buffer = DoubleBuffer(tmp_path, SPECS, grace_s=0.05)
    with buffer.reading(buffer.idle), pytest.raises(TransferError, match="readers hold"):
        buffer.claim()
    assert buffer.claim().version is None  # once released, the half is written
    buffer.close()

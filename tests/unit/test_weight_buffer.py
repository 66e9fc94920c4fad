"""The double buffer's writer never waits for ever: transfers reading the half it needs are cut off,
and a reader that cannot be cut fails the write instead of blocking it."""

import shutil
import signal
import subprocess
import sys
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


BUFFER_IN_SMALL_TMPFS = """
import sys
import torch
from astraflow.errors import ConfigError
from astraflow.messages import TensorSpec
from astraflow.weights.buffer import DoubleBuffer
n = 4 << 20  # 8 MiB of bf16 per half, in a 4 MiB tmpfs
specs = [TensorSpec(name="w", dtype="bfloat16", shape=[n], offset=0, nbytes=2 * n)]
try:
    buffer = DoubleBuffer(sys.argv[1], specs)
    buffer.write_state({"w": torch.ones(n)})
except ConfigError as e:
    print(e)
    sys.exit(3)
"""


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare")
def test_a_full_shared_memory_gives_a_clear_error_not_sigbus(tmp_path):
    """A weight buffer bigger than its filesystem's free space fails when made, with the setting named;
    before, the file was sparse and the first write through the mapping killed the process (SIGBUS)."""
    mount = tmp_path / "shm"
    mount.mkdir()
    script = f'mount -t tmpfs -o size=4m tmpfs {mount} && exec "$0" -c "$1" {mount}/run'
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", script, sys.executable, BUFFER_IN_SMALL_TMPFS],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if "mount" in proc.stderr and proc.returncode not in (3, -signal.SIGBUS):
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    assert proc.returncode == 3, (proc.returncode, proc.stderr[-500:])
    assert "no room for 8 MiB of weights" in proc.stdout and "weights.dir" in proc.stdout


def test_tied_weights_are_served_once_and_cast_where_they_live(tmp_path):
    torch = pytest.importorskip("torch")
    from astraflow.weights import layout

    embed = torch.nn.Parameter(torch.randn(16, 4))
    state = {"embed.weight": embed, "norm.weight": torch.ones(4), "lm_head.weight": embed}
    specs = layout.layout(state, "bfloat16")
    assert [s.name for s in specs] == ["embed.weight", "norm.weight"]
    buffer = DoubleBuffer(tmp_path, specs)
    half = buffer.write_state(state)  # a fp32 state, cast into the bf16 half
    served = torch.frombuffer(half.data, dtype=torch.bfloat16, count=64)
    assert torch.equal(served.view(16, 4), embed.detach().to(torch.bfloat16))
    buffer.close()


def test_a_half_is_a_safetensors_file_whose_header_gives_the_layout_back(tmp_path):
    from astraflow.weights import layout

    specs = [
        TensorSpec(name="a", dtype="bfloat16", shape=[2, 3], offset=0, nbytes=12),
        TensorSpec(name="b", dtype="bfloat16", shape=[4], offset=12, nbytes=8),
    ]
    buffer = DoubleBuffer(tmp_path, specs)
    data = buffer.idle.path.read_bytes()
    base, read = layout.read_header(data)
    assert base == buffer.idle.data_offset and [vars(s) for s in read] == [vars(s) for s in specs]
    buffer.close()
    with pytest.raises(ValueError, match="do not fit"):  # past the end of the file
        layout.read_header(data[:-1])
    head = layout.header([TensorSpec(name="i", dtype="float32", shape=[1], offset=0, nbytes=4)])
    with pytest.raises(ValueError, match="not a tensor of a served dtype"):
        layout.read_header(head.replace(b'"F32"', b'"I32"') + bytes(4))
    with pytest.raises(ValueError, match="not a safetensors file"):
        layout.read_header(b"\xff" * 16)

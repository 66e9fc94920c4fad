"""A trainer's served files (deltas, eval copies): a dropped file stays readable by the transfers
already reading it and is closed after them (its descriptor is not reused under them); a failed write
(a full disk) leaves nothing behind and serves nothing."""

import errno
import os

import pytest

from astraflow.weights import files
from astraflow.weights.served_files import ServedFiles
from astraflow.weights.wire import TransferError


class Server:
    def __init__(self) -> None:
        self.sources = {}

    def register(self, model, version, what, source) -> None:
        self.sources[(model, version, what)] = source

    def unregister(self, model, version, what) -> None:
        self.sources.pop((model, version, what), None)


def test_a_dropped_file_is_closed_only_after_its_readers(tmp_path):
    server = Server()
    served = ServedFiles(server, "policy", "full", tmp_path / "evals")
    served.add(10, b"ten")
    source = server.sources[("policy", 10, "full")]
    with source.hold(lambda: None):
        served.drop([10])
        assert served.versions == [] and not server.sources and not list(served.dir.iterdir())
        served.add(20, b"two")  # would get the same descriptor, were the dropped one closed
        assert server.sources[("policy", 20, "full")].fileno != source.fileno
        assert os.pread(source.fileno, 3, 0) == b"ten"  # the reader still reads what it asked for
    with pytest.raises(OSError):
        os.fstat(source.fileno)  # closed by its last reader
    with pytest.raises(TransferError), source.hold(lambda: None):
        pass  # looked up before the drop, held after it
    served.close()


def test_a_failed_write_leaves_nothing_behind(tmp_path, monkeypatch):
    def full_disk(path, data) -> None:
        path.write_bytes(bytes(data)[:1])
        raise OSError(errno.ENOSPC, "No space left on device")

    server = Server()
    served = ServedFiles(server, "policy", "full", tmp_path / "evals")
    monkeypatch.setattr(files, "write_private", full_disk)
    with pytest.raises(OSError):
        served.add(10, b"ten")
    assert served.versions == [] and not server.sources and not list(served.dir.iterdir())

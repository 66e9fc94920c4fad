"""The same-host path: a receiver on the trainer's host copies a version from the trainer's buffer file.

The publisher names the served half's file in the manifest (`WeightFile`: its kernel's boot id, the
file's device and inode, its path, where the data starts). A receiver whose kernel has that boot id and
that opens that very file (same device and inode: not another file at the same path, e.g. in another
container's `/dev/shm`) copies the bytes from it instead of pulling them over TCP: chunk by chunk in the
hash pool's threads, each digested right after it is copied (still in cache) and checked against the
manifest (`ChunkVerifier.fill`). A file it cannot open (another host, not there, another user's) is
no source: the receiver pulls over TCP.

The trainer writes a half again two versions later and does not wait for readers in other processes.
What is verified is the receiver's own copy, never the trainer's file: a copy torn by such a write
differs from the manifest and raises WeightIntegrityError (the receiver then pulls over TCP), and no
later write to the file can change bytes already verified.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from astraflow.errors import WeightIntegrityError
from astraflow.messages import WeightFile, WeightManifest
from astraflow.weights.verify import ChunkVerifier

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


@functools.cache
def host() -> str:
    """This kernel's boot id ('' where there is none to read: then no file is shared)."""
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return ""


def describe(path: Path, offset: int) -> WeightFile | None:
    """What a manifest says of the file at `path` (weight data from `offset`); None without a boot id."""
    if not host():
        return None
    st = os.stat(path)
    return WeightFile(host=host(), device=st.st_dev, inode=st.st_ino, path=str(path), offset=offset)


def open_file(file: WeightFile | None) -> int | None:
    """A read-only descriptor of the named file, when it is on this host and readable; else None."""
    if file is None or not host() or file.host != host():
        return None
    try:
        fd = os.open(file.path, os.O_RDONLY)
    except OSError:
        return None
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != (file.device, file.inode):
        os.close(fd)
        return None
    return fd


def copy(manifest: WeightManifest, verifier: ChunkVerifier) -> bool:
    """Fill the verifier's buffer from the manifest's file, verifying each chunk; False (nothing written)
    when the file is no source here; WeightIntegrityError when a chunk differs from the manifest (a half
    written since, or a short file: pull it over TCP)."""
    fd = open_file(manifest.file)
    if fd is None:
        return False
    offset = manifest.file.offset  # type: ignore[union-attr]

    def read(start: int, into: memoryview) -> None:
        got = 0
        while got < len(into):
            n = os.preadv(fd, [into[got:]], offset + start + got)
            if n == 0:
                raise WeightIntegrityError(f"{manifest.file.path} ends before its weights do")  # type: ignore[union-attr]
            got += n

    try:
        verifier.fill(read)
    finally:
        os.close(fd)
    return True

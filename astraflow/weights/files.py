"""Where weight buffers live on disk, who may read them, and checking a checkpoint against its manifest.

A process's buffers are under `<base>/<run>/<role>.pid<pid>@<host>`: the run directory is private (0700,
owned by this user, else refused), files in it are 0600, and a process starting there removes the
buffers of the run's processes on its host that are gone (killed before they could clean up).
"""

from __future__ import annotations

import json
import mmap
import os
import re
import shutil
import stat
import struct
import tempfile
from pathlib import Path

import structlog

from astraflow import processes
from astraflow.errors import WeightIntegrityError
from astraflow.messages import TensorSpec, WeightManifest
from astraflow.weights import layout
from astraflow.weights.buffer import WEIGHTS_FILE
from astraflow.weights.settings import WeightsSettings

log = structlog.get_logger(__name__)
CONFIG_SUFFIXES = (".json", ".txt", ".model", ".jinja")
"""Files of a model directory that a served half needs beside its weights to be a loadable checkpoint."""
OWNED = re.compile(r".+\.pid(\d+)@(.+)")
"""Name of a process's buffer directory: `<role>.pid<pid>@<host>~<pid namespace>` (`processes.pid_space`)."""


def private_dir(path: Path) -> Path:
    """`path` as a directory only this user can enter (created 0700 where missing); PermissionError when
    it is someone else's or a symlink (another user could swap what it holds)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise PermissionError(f"{path} is not a directory of this user")
    os.chmod(path, 0o700)
    return path


def write_private(path: Path, data: bytes) -> None:
    """Write `data` into a new file only this user can read."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(fd, 0o600)
        f.write(data)


def sweep(run_dir: Path) -> list[Path]:
    """Remove the buffer directories of the run's processes on this host that are gone (`weights.dir`
    may be shared by hosts); returns what was removed."""
    removed = []
    for entry in run_dir.iterdir():
        m = OWNED.fullmatch(entry.name)
        ours = m is not None and entry.is_dir() and not entry.is_symlink()
        if ours and processes.gone(m.group(2), int(m.group(1))):  # type: ignore[union-attr]
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    if removed:
        log.info("stale_weight_buffers_removed", paths=[str(p) for p in removed])
    return removed


def buffer_root(settings: WeightsSettings, run: str, role: str) -> Path:
    """This process's private buffer directory (created): under `weights.dir`, else shared memory, else
    the temp dir. Buffers that processes of the run left behind when they died are removed first."""
    if settings.dir is not None:
        base = settings.dir
    else:
        shm = Path("/dev/shm")
        tmp = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
        base = private_dir(tmp / f"astraflow-{os.getuid()}")
    run_dir = private_dir(base / run)
    sweep(run_dir)
    return private_dir(run_dir / f"{role}.pid{os.getpid()}@{processes.pid_space()}")


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """The files to copy from `model_dir` so that a half (one `model.safetensors`) loads as a checkpoint:
    config, tokenizer, chat template. Never a weight index (`model.safetensors.index.json` of a sharded
    checkpoint): beside the half's single file it would send a loader after shards that are not there."""
    return {
        p.name: p
        for p in Path(model_dir).iterdir()
        if p.suffix in CONFIG_SUFFIXES and not p.name.endswith(".index.json") and p.is_file()
    }


def verify_checkpoint(path: Path, manifest: WeightManifest) -> None:
    """Check that a checkpoint directory holds exactly the manifest's weights: its safetensors weight file
    has each of the manifest's tensors (same dtype and shape; any header, any order), and laid out as the
    manifest says they have its digest. WeightIntegrityError otherwise (nothing may load it)."""
    try:
        with open(Path(path) / WEIGHTS_FILE, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
            (n,) = struct.unpack_from("<Q", m)
            header, base = json.loads(m[8 : 8 + n]), 8 + n
            ranges = [_tensor_range(header, spec, base, len(m)) for spec in manifest.tensors]
            if sum(e - s for s, e in ranges) != manifest.nbytes:
                raise WeightIntegrityError(f"checkpoint {path}: its tensors are not {manifest.nbytes} bytes")
            with memoryview(m) as view:
                whole, _ = layout.digests_of((view[s:e] for s, e in ranges), manifest.chunk_bytes)
    except (OSError, ValueError, struct.error) as e:  # missing, unreadable, empty, not safetensors
        raise WeightIntegrityError(f"checkpoint {path}: {e}") from None
    if whole != manifest.digest:
        raise WeightIntegrityError(f"checkpoint {path}: digest {whole} != manifest {manifest.digest}")


def _tensor_range(header: dict, spec: TensorSpec, base: int, size: int) -> tuple[int, int]:
    entry = header.get(spec.name)
    want = {"dtype": layout.SAFETENSORS_DTYPES[spec.dtype], "shape": spec.shape}
    if not isinstance(entry, dict) or {k: entry.get(k) for k in want} != want:
        raise WeightIntegrityError(f"checkpoint tensor {spec.name}: {entry} is not {want}")
    start, end = (base + int(x) for x in entry["data_offsets"])
    if not base <= start <= end <= size or end - start != spec.nbytes:
        raise WeightIntegrityError(f"checkpoint tensor {spec.name}: bad data offsets")
    return start, end

"""Weight sync: transport, delta codec, sparsity on real steps, and relay chains, each against a baseline
measured in the same run.

(a) full pull of a bf16 buffer (default 1 GiB, in /dev/shm) over loopback with the weight transport
    (authenticated, 4 connections, sendfile) vs one raw `socket.sendfile` of the same file;
(b) a delta with 1% of the elements changed at random: encoded size vs full, and pull + apply vs full pull;
(c) on real training steps of the tiny model (fp32 master weights, bf16 served): the share of bf16
    elements that change per step and the delta's size vs full;
(d) one version to 8 receivers, every process's egress capped at the same rate: a relay chain (each
    pulls from the previous one while it is still receiving) vs all pulling from the trainer.

    python tests/bench/weight_sync.py [--gib 1.0] [--relay-mib 64] [--rate-mbps 400] [--rounds 3] [--steps 5]
"""

from __future__ import annotations

import argparse
import mmap
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `tests` helpers, run as a script

from _smoke import parse

from astraflow.weights import codec
from astraflow.weights.server import WeightServer
from astraflow.weights.transport import Source, pull

SECRET = b"bench"


def shm_dir() -> Path:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return Path(tempfile.mkdtemp(prefix="af-bench-", dir=base))


def make_file(path: Path, nbytes: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        for start in range(0, nbytes, 64 << 20):
            n = min(64 << 20, nbytes - start)
            f.write(rng.integers(0, 2**16, n // 2, dtype=np.uint16).tobytes())


def mapped(path: Path, nbytes: int, create: bool = False) -> tuple[object, memoryview]:
    if create:
        with open(path, "wb") as f:
            f.truncate(nbytes)
    f = open(path, "r+b")  # lives as long as the mapping
    m = mmap.mmap(f.fileno(), nbytes)
    return (f, m), memoryview(m)


def raw_sendfile(path: Path, into: memoryview) -> float:
    """One TCP connection, the sender calls sendfile once for the whole file."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def send() -> None:
        conn, _ = server.accept()
        with conn, open(path, "rb") as f:
            conn.sendfile(f)

    t = threading.Thread(target=send)
    t.start()
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as c:
        got = 0
        while got < len(into):
            got += c.recv_into(into[got:], min(1 << 20, len(into) - got))
    took = time.perf_counter() - started
    t.join()
    server.close()
    return took


def bench_full(d: Path, nbytes: int, rounds: int) -> dict:
    src = d / "full.bin"
    make_file(src, nbytes)
    f = open(src, "rb")
    server = WeightServer(SECRET)
    server.register("m", 1, "full", Source(f.fileno(), 0, nbytes))
    _, into = mapped(d / "recv.bin", nbytes, create=True)
    raw, ours = [], []
    for _ in range(rounds):
        raw.append(raw_sendfile(src, into))
        started = time.perf_counter()
        pull(server.endpoint, SECRET, "m", 1, "full", into, parallel=4)
        ours.append(time.perf_counter() - started)
    server.close()
    f.close()
    return {"raw_s": statistics.median(raw), "ours_s": statistics.median(ours)}


def bench_delta(d: Path, nbytes: int) -> dict:
    _, old = mapped(d / "full.bin", nbytes)
    new = bytearray(old)
    view = np.frombuffer(new, np.uint16)
    rng = np.random.default_rng(1)
    idx = rng.choice(len(view), len(view) // 100, replace=False)
    view[idx] ^= 1
    started = time.perf_counter()
    delta = codec.encode(old, new, 2)
    encode_s = time.perf_counter() - started
    (d / "delta.bin").write_bytes(delta)
    f = open(d / "delta.bin", "rb")
    server = WeightServer(SECRET)
    server.register("m", 2, "delta", Source(f.fileno(), 0, len(delta)))
    server.register("m", 2, "full", Source(os.open(d / "full.bin", os.O_RDONLY), 0, nbytes))
    _, target = mapped(d / "recv.bin", nbytes)
    target[:] = old
    started = time.perf_counter()
    buf = bytearray(len(delta))
    pull(server.endpoint, SECRET, "m", 2, "delta", memoryview(buf), parallel=4)
    codec.apply(target, buf)
    delta_s = time.perf_counter() - started
    assert bytes(target) == bytes(new)
    started = time.perf_counter()
    pull(server.endpoint, SECRET, "m", 2, "full", target, parallel=4)
    full_s = time.perf_counter() - started
    server.close()
    return {
        "delta_bytes": len(delta),
        "ratio": nbytes / len(delta),
        "encode_s": encode_s,
        "delta_pull_apply_s": delta_s,
        "full_pull_s": full_s,
    }


def bench_real_steps(steps: int = 5) -> list[tuple[float, float]]:
    """(changed share, full/delta size) per step of the tiny model at the default recipe's lr."""
    import torch

    from astraflow import tiny
    from astraflow.trainer.settings import TrainerSettings
    from astraflow.trainer.step import PolicyTrainer
    from astraflow.weights import layout
    from tests.trainer_helpers import make_batch

    path = tiny.build(
        tempfile.mkdtemp(prefix="af-tiny-"), hidden=128, layers=4, heads=4, kv_heads=4, intermediate=512
    )
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    trainer = PolicyTrainer(model, TrainerSettings(lr=2e-4))
    specs = layout.layout(model.state_dict(), "bfloat16")

    def served() -> bytes:
        sd = model.state_dict()
        return b"".join(
            sd[s.name].detach().to(torch.bfloat16).view(torch.uint16).numpy().tobytes() for s in specs
        )

    rng = np.random.default_rng(0)
    out, before = [], served()
    for _ in range(steps):
        seqs = [[5, 6, *rng.integers(7, 500, 6).tolist()] for _ in range(16)]
        trainer.step(make_batch(model, seqs, rng.integers(0, 2, 16).astype(float).tolist()))
        after = served()
        changed = len(codec.changed_indices(before, after, 2)) / (len(after) // 2)
        out.append((changed, len(after) / len(codec.encode(before, after, 2))))
        before = after
    return out


def bench_relay(d: Path, nbytes: int, rate: float, receivers: int = 8) -> dict:
    src = d / "relay-src.bin"
    make_file(src, nbytes, seed=2)
    f = open(src, "rb")
    times = {}
    for mode in ("star", "chain"):
        trainer = WeightServer(SECRET, egress_bps=rate)
        trainer.register("m", 1, "full", Source(f.fileno(), 0, nbytes))
        servers, targets, sources = [], [], []
        for i in range(receivers):
            _, view = mapped(d / f"relay-{i}.bin", nbytes, create=True)
            fd = os.open(d / f"relay-{i}.bin", os.O_RDONLY)
            source = Source(fd, 0, nbytes, complete=False)
            server = WeightServer(SECRET, egress_bps=rate)
            server.register("m", 1, "full", source)
            servers.append(server)
            targets.append(view)
            sources.append(source)

        # Star: all from the trainer. Chain: each from the one before, while it is still receiving.
        ends = (
            [trainer.endpoint] * receivers
            if mode == "star"
            else [trainer.endpoint] + [s.endpoint for s in servers[:-1]]
        )
        started = time.perf_counter()
        with ThreadPoolExecutor(receivers) as pool:
            jobs = [
                pool.submit(pull, end, SECRET, "m", 1, "full", view, 1, src.arrived)
                for end, view, src in zip(ends, targets, sources, strict=True)
            ]
            for job in jobs:
                job.result()
        times[mode] = time.perf_counter() - started
        for s in [trainer, *servers]:
            s.close()
    f.close()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--relay-mib", type=int, default=64)
    ap.add_argument("--rate-mbps", type=float, default=400.0, help="egress cap per process, megabits/s")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5, help="(c): training steps of the tiny model")
    args = parse(ap, gib=1 / 64, relay_mib=2, rounds=1, steps=2)
    nbytes = int(args.gib * (1 << 30)) // 2 * 2
    d = shm_dir()
    try:
        full = bench_full(d, nbytes, args.rounds)
        delta = bench_delta(d, nbytes)
        steps = bench_real_steps(args.steps)
        relay = bench_relay(d, args.relay_mib << 20, args.rate_mbps * 1e6 / 8)
    finally:
        for p in d.iterdir():
            p.unlink()
        d.rmdir()
    gib = nbytes / (1 << 30)
    raw_s, ours_s = full["raw_s"], full["ours_s"]
    print(f"(a) full pull of {gib:.2f} GiB over loopback, median of {args.rounds}")
    print(f"    raw sendfile {raw_s:.3f} s ({gib / raw_s:.2f} GiB/s)", end="")
    print(f"   astraflow {ours_s:.3f} s ({gib / ours_s:.2f} GiB/s)   ratio {raw_s / ours_s:.2f}")
    apply_s, full_s = delta["delta_pull_apply_s"], delta["full_pull_s"]
    print(f"(b) 1% of elements changed: delta {delta['delta_bytes'] / 2**20:.1f} MiB, ", end="")
    print(f"{delta['ratio']:.1f}x smaller than full; encode {delta['encode_s']:.2f} s")
    print(f"    pull+apply {apply_s:.3f} s vs full pull {full_s:.3f} s ({full_s / apply_s:.1f}x faster)")
    print("(c) tiny model (1.05M params), lr 2e-4, per step: changed share / full-to-delta size")
    print("    " + "  ".join(f"{c:.1%} / {r:.2f}x" for c, r in steps))
    star, chain = relay["star"], relay["chain"]
    print(f"(d) {args.relay_mib} MiB to 8 receivers, egress {args.rate_mbps:.0f} Mbit/s per process:", end="")
    print(f" star {star:.2f} s, chain {chain:.2f} s, ratio {chain / star:.2f}")


if __name__ == "__main__":
    main()

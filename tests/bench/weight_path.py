"""The weight path at a real model's size, stage by stage, against one host memcpy of the served bytes.

A random-weight model of the shape (`tiny.SHAPES`: the architecture's configuration, tied embeddings as
the released model; nothing fetched) is the fp32 master; the served weights are bf16. Each version goes
the whole way a run takes it: the trainer publishes (`trainer blocked`: until its next step may start),
the publisher's background pass (digests, delta, manifest, `versions`), a receiver's pull (pull, verify,
apply), and an hf engine's pause, load and resume (`load`); `end to end` is publish to serving. Versions:
0 (full, first touch), 1 and 2 (a real AdamW step at lr 1e-6 each: deltas), 3 (full, `full_every` 3).
The last line reports version 2 as the delta and version 3 as the full, each stage as a multiple of `m`,
one `np.copyto` of the served bytes between two warm buffers (the physical limit here), and the share of
bf16 elements the second step changed.

On a shape whose AdamW state does not fit in memory here (`--emulate-step`, the default for 1.5B) the
step is Adam's first step done directly, `p -= lr * sign(g)` with a random `g` (every element moves by
`lr`, as in Adam's first step, where m / sqrt(v) = sign(g)); the line says so. `--no-engine` leaves the
engine load out (`load` 0, `end to end` without it). The script first estimates its peak memory (the
1.5B shape's fp32 master, four bf16 halves in `/dev/shm` and an engine's copy: about 22 GiB) and, when
that exceeds what the machine has available, puts the buffers on disk, then leaves the engine out, saying
so. `--over-tcp`: the receiver pulls over TCP as from another host (by default, on the trainer's host, a
full version is copied from the trainer's file).

    python tests/bench/weight_path.py --shape qwen2.5-0.5b [--tokens 256] [--emulate-step] [--over-tcp]
    python tests/bench/weight_path.py --smoke   # the tiny model (CI)

`run(model_dir, device=...)` is the same measurement for other scripts (`tests/gpu/check.py`): on CUDA the
master model lives on the GPU, `publish` gets device tensors (cast to bf16 on the device, then copied), the
engine loads onto the GPU, and `m` is one device-to-host copy of the served bytes into pinned memory.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from _smoke import parse

from astraflow import redis_server, tiny
from astraflow.config import RedisSettings, StreamsSettings
from astraflow.engines.hf import HFEngine
from astraflow.engines.settings import EngineSettings
from astraflow.messages import WeightManifest, decode
from astraflow.streams import Bus
from astraflow.weights import layout
from astraflow.weights.published import run_secret
from astraflow.weights.publisher import WeightPublisher
from astraflow.weights.receiver import WeightReceiver
from astraflow.weights.server import WeightServer
from astraflow.weights.settings import WeightsSettings

LR = 1e-6
STAGES = ("blocked", "background", "scan", "encode", "pull", "verify", "apply", "receive", "load")
STAGES += ("end to end",)


def memcpy_s(nbytes: int, rounds: int = 5) -> float:
    """Fastest of `rounds` copies of `nbytes` between two buffers already touched, in pages of the size
    the weight buffers have (a `/dev/shm` file is mapped in 4 KiB pages; numpy asks for huge pages, which
    the kernel grants when it has them free: a limit the buffers could not reach)."""
    huge = np._core.multiarray._set_madvise_hugepage(False)
    try:
        a = np.ones(nbytes, np.uint8)
        b = np.zeros(nbytes, np.uint8)
    finally:
        np._core.multiarray._set_madvise_hugepage(huge)
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t)
    return best


def d2h_s(nbytes: int, device: str, rounds: int = 5) -> float:
    """Fastest of `rounds` copies of `nbytes` from `device` into pinned host memory (the limit there)."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    best = float("inf")
    for _ in range(rounds):
        torch.cuda.synchronize(device)
        t = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t)
    return best


def make_step(model, tokens: int, emulate: bool):
    import torch

    device = next(model.parameters()).device
    if emulate:

        @torch.no_grad()
        def emulated(seed: int) -> None:
            g = torch.Generator().manual_seed(seed)
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g).sign_().to(device), alpha=-LR)

        return emulated
    optim = torch.optim.AdamW(model.parameters(), lr=LR)
    vocab = model.config.vocab_size

    def real(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab, (2, tokens // 2), generator=g).to(device)
        model(input_ids=ids, labels=ids).loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)

    return real


async def measure(
    model_dir: Path,
    url: str,
    root: Path,
    tokens: int,
    emulate: bool,
    engine_load: bool,
    device: str,
    same_host: bool = True,
) -> tuple[list[dict], dict]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    state = model.state_dict()  # live tensors: the trainer awaits `publish` before its next step
    specs = layout.layout(state, "bfloat16")
    bus = Bus.connect(url, "weight-path", RedisSettings(), StreamsSettings())
    settings = WeightsSettings(full_every=3, keep_deltas=2, **({} if same_host else {"same_host": False}))
    secret = await run_secret(bus, settings)
    pub = WeightPublisher(bus, settings, "policy", specs, root / "trainer", secret)
    rx = WeightReceiver(
        bus, settings, "policy", root / "raas", secret, WeightServer(secret), model_dir=model_dir
    )
    engine = None
    if engine_load:
        engine = HFEngine(EngineSettings(type="hf", model=str(model_dir), dtype="bfloat16", device=device))
        await engine.start()
    step = make_step(model, tokens, emulate)
    rows = []
    try:
        for v in range(4):
            if v:
                step(v)
            t0 = time.perf_counter()
            await pub.publish(state, v, step=v)
            t1 = time.perf_counter()
            await pub.wait()
            t2 = time.perf_counter()
            copies = rx.stats["local_copies"]
            half = await rx.sync(bus.keys.weights("policy", v), v)
            t3 = time.perf_counter()
            if engine is not None:
                with rx.buffer.reading(half):  # type: ignore[union-attr]
                    await engine.pause()
                    await engine.load_weights(str(half.dir), v)
                    await engine.resume()
                assert engine.version == v
            t4 = time.perf_counter()
            manifest = decode(await bus.redis.hgetall(bus.keys.weights("policy", v)), WeightManifest)
            rows.append(
                {
                    "version": v,
                    "kind": manifest.kind,
                    "blocked": t1 - t0,
                    "background": t2 - t1,
                    **getattr(rx, "timings", {}),  # (stage splits: not in older versions)
                    **{"encode" if k == "delta" else k: x for k, x in getattr(pub, "timings", {}).items()},
                    "receive": t3 - t2,
                    "load": t4 - t3,
                    "end to end": t4 - t0,
                    "delta_bytes": manifest.delta_nbytes,
                    "via": "file" if rx.stats["local_copies"] > copies else "TCP",
                }
            )
        served = np.frombuffer(pub.buffer.served.data, np.uint16)  # type: ignore[union-attr]
        before = np.frombuffer(pub.buffer.idle.data, np.uint16)
        sparsity = {
            "changed": float(np.count_nonzero(served != before)) / len(served),
            "nbytes": len(served) * 2,
            **(
                {"loaded": True, "tensor": None}
                if engine is None
                else loaded(engine.model, specs, served, before)
            ),
        }
    finally:
        if engine is not None:
            await engine.close()
        rx.close()
        rx.server.close()
        await pub.close()
        await bus.close()
    return rows, sparsity


def loaded(model, specs, served: np.ndarray, before: np.ndarray) -> dict:
    """Whether `model` holds the served version: {"loaded": its parameter equals the served bytes of the
    tensor the last step changed most, "tensor": that tensor's name}. A tensor that the step left alone
    (a norm weight that small steps cannot move in bf16) would equal both versions and prove nothing, so
    `loaded` is False where no tensor changed."""
    import torch

    def part(flat: np.ndarray, spec) -> np.ndarray:
        return flat[spec.offset // 2 : (spec.offset + spec.nbytes) // 2]

    changed, spec = max(
        ((np.count_nonzero(part(served, s) != part(before, s)), s) for s in specs), key=lambda c: c[0]
    )
    if not changed:
        return {"loaded": False, "tensor": None}
    new = torch.from_numpy(part(served, spec).copy()).view(torch.bfloat16).view(spec.shape)
    held = model.get_parameter(spec.name).detach().to("cpu", torch.bfloat16)
    return {"loaded": torch.equal(held, new), "tensor": spec.name}


def run(
    model_dir: Path,
    tokens: int = 256,
    emulate: bool = False,
    device: str = "cpu",
    buffers: Path | None = None,
    engine: bool = True,
    same_host: bool = True,
) -> dict:
    """The whole measurement of the model in `model_dir` (its own Redis; buffers under `buffers`, default
    /dev/shm; `engine` False: no engine load; `same_host` False: receivers pull over TCP, as from another
    host): `rows` (per version, seconds per stage), `sparsity`, `m` (seconds: a host memcpy, or from a
    GPU one device-to-host copy; the faster of one before and one after, so that other load on a shared
    machine at either moment does not flatter the ratios) and `gib` served."""
    nbytes = served_bytes(model_dir)
    limit = memcpy_s if device == "cpu" else functools.partial(d2h_s, device=device)
    m = limit(nbytes)
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory(dir=buffers or "/dev/shm") as shm:
        server = redis_server.start(Path(tmp) / "redis")
        try:
            rows, sparsity = asyncio.run(
                measure(model_dir, server.url, Path(shm), tokens, emulate, engine, device, same_host)
            )
        finally:
            server.stop()
    m = min(m, limit(sparsity["nbytes"]))
    return {"rows": rows, "sparsity": sparsity, "m": m, "gib": sparsity["nbytes"] / 2**30}


def served_bytes(model_dir: Path) -> int:
    """Bytes served in bf16 of the model in `model_dir` (tied embeddings once), from its config alone."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return 2 * sum(p.numel() for p in model.parameters())  # (a tied parameter is listed once)


def peak_bytes(served: int, engine: bool, in_memory_buffers: bool, emulate: bool) -> int:
    """Rough peak memory of a run: the fp32 master (2x the bf16 bytes), AdamW's state and gradients
    (4x more) unless emulated, four buffer halves (trainer and receiver) when in memory (`/dev/shm`; on
    disk they are page cache the kernel can write back), the engine's bf16 copy, and transients (a
    tensor's step, the bench's comparisons: about half the served bytes)."""
    master = 2 * served
    return master * (1 if emulate else 3) + 4 * served * in_memory_buffers + served * engine + served // 2


def available_bytes() -> int:
    """MemAvailable of this machine (what other processes leave)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def last_line(shape: str, result: dict) -> str:
    """The bench's one-line summary: version 2 as the delta, version 3 as the full, in multiples of `m`."""
    rows, sparsity, m = result["rows"], result["sparsity"], result["m"]
    delta, full = rows[2], rows[3]
    return (
        f"weight path {shape}: {result['gib']:.2f} GiB served, trainer blocked {delta['blocked'] / m:.1f}m, "
        f"background {delta['background'] / m:.1f}m, receive {full['receive'] / m:.1f}m, "
        f"load {delta['load'] / m:.1f}m, end to end {full['end to end'] / m:.1f}m (full) "
        f"{delta['end to end'] / m:.1f}m (delta); lr 1e-6 step: {sparsity['changed'] * 100:.2f}% "
        f"changed, delta {sparsity['nbytes'] / max(delta['delta_bytes'], 1):.0f}x smaller"
    )


def fit(args: argparse.Namespace, served: int, tmp: str) -> None:
    """Keep the run within this machine's available memory: buffers on disk (under the temp dir) rather
    than in `/dev/shm` when they would not fit, then no engine load; says what it chose."""
    free = available_bytes() * 0.9
    in_memory = args.dir is None
    need = peak_bytes(served, not args.no_engine, in_memory, args.emulate_step)
    print(f"peak memory about {need / 2**30:.1f} GiB ({free / 2**30:.1f} GiB available)", flush=True)
    if need > free and in_memory:
        args.dir, in_memory = Path(tmp), False
        need = peak_bytes(served, not args.no_engine, in_memory, args.emulate_step)
        print(f"  buffers on disk instead of /dev/shm: about {need / 2**30:.1f} GiB", flush=True)
    if need > free and not args.no_engine:
        args.no_engine = True
        need = peak_bytes(served, False, in_memory, args.emulate_step)
        print(f"  no engine load: about {need / 2**30:.1f} GiB", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(tiny.SHAPES), default="qwen2.5-0.5b")
    ap.add_argument("--tokens", type=int, default=256, help="tokens in the real step's batch")
    ap.add_argument("--emulate-step", action="store_true", help="Adam's first step without its state")
    ap.add_argument("--dir", type=Path, default=None, help="buffers here (default: /dev/shm)")
    ap.add_argument("--no-engine", action="store_true", help="no engine load (memory: 1.5B on 24 GB)")
    ap.add_argument("--model-dir", type=Path, default=None, help="the shape, built before (tiny.build_shape)")
    ap.add_argument("--over-tcp", action="store_true", help="receivers pull over TCP, as from another host")
    args = parse(ap, tokens=16)
    if args.shape == "qwen2.5-1.5b":
        args.emulate_step = True  # fp32 weights, gradients and AdamW state: 25 GB
    if args.smoke:  # the tiny model, not a shape
        args.shape = "tiny"
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir
        if model_dir is None:
            print(f"building {args.shape} ...", flush=True)
            model = Path(tmp) / "model"
            model_dir = tiny.build(model) if args.smoke else tiny.build_shape(model, args.shape)
        fit(args, served_bytes(model_dir), tmp)
        result = run(
            model_dir, args.tokens, args.emulate_step, "cpu", args.dir, not args.no_engine, not args.over_tcp
        )
    rows, sparsity, m, gib = result["rows"], result["sparsity"], result["m"], result["gib"]
    print(
        f"{args.shape}: {gib:.2f} GiB served (bf16, tied embeddings once); m = one memcpy = {m * 1000:.0f} ms"
    )
    print(f"{'version':<9}{'kind':<7}" + "".join(f"{s:>12}" for s in STAGES) + f"{'delta MiB':>11}")
    for r in rows:
        cells = "".join(f"{r.get(s, 0) * 1000:>10.0f}ms" for s in STAGES)
        print(f"{r['version']:<9}{r['kind']:<7}{cells}{r['delta_bytes'] / 2**20:>11.1f}")
    print(f"{'(x m)':<16}" + "".join(f"{rows[2].get(s, 0) / m:>11.1f}m" for s in STAGES) + "  (version 2)")
    assert sparsity["loaded"], "the engine does not hold the published weights"
    how = "emulated: Adam's first step, lr x sign(g)" if args.emulate_step else "AdamW, fp32 master"
    print(
        f"version 2 is the second lr-1e-6 step ({how}); version 3 a full sync, received by {rows[3]['via']}"
    )
    print(last_line(args.shape, result))


if __name__ == "__main__":
    main()

"""vLLM-CPU beside a CPU-bound neighbour: its processes napping on their shared-memory queue
(`engine.vllm.cpu_queue_nap_us`, 200 us) against vLLM's own wait (0: spin, yielding the core).

In a run on a machine of few cores the vLLM server shares them with the trainer. The neighbour here
stands in for it: a process multiplying 256x256 matrices on one torch thread as fast as it can. Each
arm starts its own server (the setting is read at start), as `tests/bench/vllm_groups.py` does (the
LoRA recipe's tiny shape, an adapter with `--lora`, 16 groups of 8 in flight), starts the neighbour,
runs a warm-up round and then a measured round of `--groups` groups: the server's samples/s and the
neighbour's matmuls/s over that round. Arms alternate, `--rounds` each; medians.

    python tests/bench/vllm_queue_nap.py [--groups 512] [--rounds 3] [--nap-us 200] [--lora] [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from _neighbour import Neighbour
from _smoke import parse
from vllm_groups import load_args, medians, model_and_prompts, round_, started


async def arm(a: argparse.Namespace, tmp: Path, model: Path, prompts, nap_us: int) -> tuple[float, float]:
    """(samples/s, neighbour matmuls/s) of one measured round on a fresh server napping `nap_us`."""
    engine = await started(model, tmp, a.lora, cpu_queue_nap_us=nap_us)
    neighbour = Neighbour(threads=1)
    try:
        await asyncio.to_thread(neighbour.__enter__)
        await round_(engine, prompts, a.slots, a.samples)  # warm-up
        done, wall = neighbour.count.value, time.perf_counter()
        rate, _ = await round_(engine, prompts, a.slots, a.samples)
        return rate, (neighbour.count.value - done) / (time.perf_counter() - wall)
    finally:
        neighbour.__exit__()
        await engine.close()


def main() -> None:
    p = load_args(__doc__.splitlines()[0], groups=512)
    p.add_argument("--nap-us", type=int, default=200)
    a = parse(p, groups=8, slots=4, rounds=1)
    arms = {f"nap {a.nap_us} us": a.nap_us, "spin (vLLM)": 0}
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in arms}
    with tempfile.TemporaryDirectory() as tmp:
        model, prompts = model_and_prompts(Path(tmp), a.groups)
        for r in range(a.rounds):
            for name, nap_us in arms.items():
                results[name].append(asyncio.run(arm(a, Path(tmp), model, prompts, nap_us)))
                print(
                    f"round {r} {name:<12} {results[name][-1][0]:8.1f} samples/s "
                    f"{results[name][-1][1]:8.1f} neighbour matmuls/s"
                )
    med = medians(a, results)
    print(f"{'wait':<14} {'samples/s':>10} {'neighbour/s':>12}")
    for name, (rate, work) in med.items():
        print(f"{name:<14} {rate:>10.1f} {work:>12.1f}")
    (n_rate, n_work), (s_rate, s_work) = med.values()
    work = n_work / s_work if s_work else float("inf")  # a neighbour starved for a whole short round
    print(f"vllm queue nap: nap/spin samples/s {n_rate / s_rate:.2f}x, neighbour's work {work:.2f}x")


if __name__ == "__main__":
    main()

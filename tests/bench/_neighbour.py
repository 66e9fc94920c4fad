"""A CPU-bound neighbour process for the benches that measure sharing a machine: it multiplies 256x256
matrices on `threads` torch threads as fast as it can, counting them in a shared `Value`."""

from __future__ import annotations

import multiprocessing as mp
import time


def _work(count, stop, threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    a = torch.randn(256, 256)
    while not stop.is_set():
        a = torch.tanh(a @ a)
        with count.get_lock():
            count.value += 1


class Neighbour:
    """`with Neighbour(threads) as n:` a started neighbour (its first matmul done: a spawned process takes
    seconds to import torch); `n.count.value` is its matmuls so far."""

    def __init__(self, threads: int = 1, timeout_s: float = 120.0) -> None:
        ctx = mp.get_context("spawn")
        self.count, self._stop = ctx.Value("q", 0), ctx.Event()
        self._proc = ctx.Process(target=_work, args=(self.count, self._stop, threads))
        self.timeout_s = timeout_s

    def __enter__(self) -> Neighbour:
        self._proc.start()
        deadline = time.monotonic() + self.timeout_s
        while self.count.value == 0:
            if time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"the neighbour did no work in {self.timeout_s:.0f} s")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._proc.pid is not None:
            self._proc.join(timeout=30)

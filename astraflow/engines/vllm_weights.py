"""How a load puts new weights into the vLLM server (`engine.vllm.weight_transfer`): one `WeightLoader` per
backend and `make_weight_loader` to pick one.

Built: `files`, the server's workers reload the checkpoint directory the RaaS pulled and verified. Not
built: vLLM's native weight transfer (`/init_weight_transfer_engine` once, then `/start_weight_update`,
`/update_weights`, `/finish_weight_update` per version, the trainer sending over NCCL or CUDA IPC), which
needs a GPU node to be tested; its loader goes here, chosen by the same setting.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from astraflow.engines.base import WeightLoader
from astraflow.engines.settings import EngineSettings
from astraflow.errors import ConfigError

Control = Callable[[str, dict], Awaitable[None]]
"""POSTs a JSON body to a path of the server's control endpoints; raises on an error reply."""

NATIVE = ("nccl", "ipc")
"""vLLM's native weight transfer backends: not built here yet."""


class FileReload(WeightLoader):
    """Every server worker reloads the checkpoint directory from disk (`reload_weights`)."""

    def __init__(self, control: Control) -> None:
        self.control = control

    async def load(self, path: str) -> None:
        await self.control("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}})


def make_weight_loader(settings: EngineSettings, control: Control) -> WeightLoader:
    t = settings.vllm.weight_transfer
    if t == "files":
        return FileReload(control)
    if t in NATIVE:
        raise ConfigError(
            f"engine.vllm.weight_transfer={t}: vLLM's native {t} weight transfer is not built yet "
            "(no GPU node to test it on); use files"
        )
    raise ValueError(f"unknown weight transfer type: {t!r}")

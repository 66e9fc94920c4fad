"""How a load puts new weights into the vLLM server (`engine.vllm.weight_transfer`): one `WeightLoader` per
backend and `make_weight_loader` to pick one.

Built: `buffer`, astraflow's weight-transfer engine (`vllm_buffer.py`, registered by the plugin of
`vllm_plugin.py`): set up once per server (`/init_weight_transfer_engine`), then per version
`/start_weight_update`, `/update_weights` naming the safetensors files of the verified half,
`/finish_weight_update`; the workers map the files and copy them into the model. `files`, the fallback:
the server's workers reload the checkpoint directory the RaaS pulled and verified. Not built: vLLM's
native NCCL or CUDA-IPC transfer from a trainer, which needs a GPU node to be tested.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

from astraflow.engines.base import WeightLoader
from astraflow.engines.settings import EngineSettings
from astraflow.engines.vllm_server import weight_transfer
from astraflow.errors import ConfigError

Control = Callable[[str, dict | None], Awaitable[None]]
"""POSTs a JSON body to a path of the server's control endpoints; raises on an error reply."""

NATIVE = ("nccl", "ipc")
"""vLLM's native weight transfer backends: not built here yet."""


class FileReload(WeightLoader):
    """Every server worker reloads the checkpoint directory from disk (`reload_weights`)."""

    def __init__(self, control: Control) -> None:
        self.control = control

    async def load(self, path: str) -> None:
        await self.control("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}})


class BufferTransfer(WeightLoader):
    """The server's workers copy the version from its safetensors files, mapped (`vllm_buffer.py`)."""

    def __init__(self, control: Control) -> None:
        self.control = control

    async def setup(self) -> None:
        await self.control("/init_weight_transfer_engine", {"init_info": {}})

    async def load(self, path: str) -> None:
        files = sorted(str(f.resolve()) for f in Path(path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {path}")
        await self.control("/start_weight_update", None)
        await self.control("/update_weights", {"update_info": {"files": files}})  # a failure ends the update
        await self.control("/finish_weight_update", {})


def make_weight_loader(settings: EngineSettings, control: Control) -> WeightLoader:
    t = weight_transfer(settings)
    if t == "buffer":
        return BufferTransfer(control)
    if t == "files":
        return FileReload(control)
    if t in NATIVE:
        raise ConfigError(
            f"engine.vllm.weight_transfer={t}: vLLM's native {t} weight transfer is not built yet "
            "(no GPU node to test it on); use buffer or files"
        )
    raise ValueError(f"unknown weight transfer type: {t!r}")

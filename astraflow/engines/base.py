"""The engine protocol: token-in/token-out generation with per-token weight versions, and weight loads
(`WeightLoader`: the step that puts a version's weights into the model)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from astraflow.engines.settings import EngineSettings


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    """0 = greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 = no top-k cut."""
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    """Generation stops after any of these (the model's eos always stops it); the stop token is kept."""
    seed: int | None = None
    """Same seed, same prompt, same weights: same tokens (batched or not)."""


@dataclass(frozen=True)
class GenerateRequest:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class GenerateResponse:
    token_ids: list[int]
    logprobs: list[float]
    """Log-probability of each sampled token under the distribution it was sampled from: logits divided
    by the temperature (1 when greedy), cut by top-k/top-p and renormalised (vLLM's processed_logprobs)."""
    versions: list[int]
    """Weight version that produced each token."""
    finish_reason: str
    """`stop` (a stop or eos token) or `length`."""
    timings: dict[str, float] = field(default_factory=dict)
    sampling: SamplingParams | None = None
    """The parameters the tokens were sampled with (the request's; every engine sets them): trajectories
    carry their processing to the trainer. None: not known, scored as plain sampling."""


class Engine(ABC):
    """An inference engine. Many concurrent `generate` calls are the normal case.

    `pause` returns once no token is being produced; in-flight requests wait (they are not lost) and
    continue after `resume`, with tokens produced after a `load_weights` tagged with the new version.
    """

    version: int = 0

    @classmethod
    def create(cls, settings: EngineSettings, log_path: str | Path | None = None) -> Engine:
        """The engine `settings` describe (not started); `log_path`: where an engine that runs a server
        process writes that server's log."""
        return cls(settings)  # type: ignore[call-arg]

    @abstractmethod
    async def start(self) -> None: ...

    @abstractmethod
    async def close(self) -> None: ...

    @abstractmethod
    async def generate(self, request: GenerateRequest) -> GenerateResponse: ...

    @abstractmethod
    async def pause(self) -> None: ...

    @abstractmethod
    async def load_weights(self, path: str, version: int) -> None:
        """Load the Hugging Face checkpoint directory `path` as `version`; only while paused."""

    tensors_device: str | None = None
    """The device whose tensors `load_tensors` takes (None: the engine loads versions from files only)."""

    async def load_tensors(self, tensors: Mapping[str, Any], version: int) -> None:
        """Load a version given as torch tensors on `tensors_device`, by the names of a Hugging Face
        checkpoint, as `version`; only while paused. Only engines with a `tensors_device` implement it."""
        raise NotImplementedError(f"{type(self).__name__} loads versions from files only")

    @abstractmethod
    async def resume(self) -> None: ...

    @abstractmethod
    async def healthy(self) -> bool: ...


class WeightLoader(ABC):
    """Puts one version's weights into a paused engine's model: the step a weight transfer backend (vLLM's
    native NCCL or CUDA-IPC transfer) replaces. The engine keeps the rest of a load: pausing, resuming and
    labelling the tokens with the new version."""

    async def setup(self) -> None:  # noqa: B027 (a hook most backends do not need)
        """Prepare the backend once per engine start (a restarted server included), before any load."""

    @abstractmethod
    async def load(self, path: str) -> None:
        """Make the model hold the weights of `path`, a Hugging Face checkpoint directory already verified
        against its manifest."""

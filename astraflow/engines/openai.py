"""An OpenAI-compatible completions endpoint with no weight sync: a fixed judge or opponent.

The endpoint must accept token-id prompts and return token ids (`return_token_ids`, as vLLM servers do).
Its tokens carry version -1: no trained policy produced them.
"""

from __future__ import annotations

import time

from astraflow.engines.base import Engine, GenerateRequest, GenerateResponse
from astraflow.engines.client import GenerationClient
from astraflow.engines.settings import EngineSettings

FIXED_VERSION = -1


class OpenAIEngine(Engine):
    def __init__(self, settings: EngineSettings) -> None:
        if not settings.base_url:
            raise ValueError("engine.base_url is required for the openai engine")
        self.settings = settings
        self.version = FIXED_VERSION

    async def start(self) -> None:
        key = self.settings.api_key
        headers = {"Authorization": f"Bearer {key.get_secret_value()}"} if key else {}
        self._http = GenerationClient(self.settings.base_url, headers)

    async def close(self) -> None:
        await self._http.close()

    async def healthy(self) -> bool:
        return await self._http.answers("/models", 5.0)

    async def generate(self, request: GenerateRequest) -> GenerateResponse:
        p = request.params
        body = {
            "model": self.settings.model,
            "prompt": request.prompt_ids,
            "max_tokens": p.max_new_tokens,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "logprobs": 0,
            "return_token_ids": True,
            "stop_token_ids": list(p.stop_token_ids),
        }
        if p.seed is not None:
            body["seed"] = p.seed
        started = time.perf_counter()
        choice = (await self._http.post("/completions", body))["choices"][0]
        if "token_ids" not in choice:
            raise ValueError(f"{self.settings.base_url} does not return token ids (return_token_ids)")
        tokens = choice["token_ids"]
        return GenerateResponse(
            tokens,
            choice["logprobs"]["token_logprobs"],
            [FIXED_VERSION] * len(tokens),
            "stop" if choice["finish_reason"] == "stop" else "length",
            {"generate_s": time.perf_counter() - started},
            p,
        )

    async def pause(self) -> None:
        """Nothing to pause: the endpoint's weights never change."""

    async def load_weights(self, path: str, version: int) -> None:
        raise NotImplementedError("the openai engine serves fixed weights")

    async def resume(self) -> None:
        """Nothing to resume."""


ENGINE = OpenAIEngine
"""What `engine.type: openai` runs (`engines.make_engine`)."""

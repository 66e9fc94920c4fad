"""An exported checkpoint (`astraflow export`) served by the real vLLM engine: it generates what the
checkpoint's model generates, so the trained policy, not its starting weights, was loaded."""

import importlib.util
import os
from pathlib import Path

import pytest

from astraflow.engines.base import GenerateRequest, SamplingParams
from astraflow.engines.settings import EngineSettings
from astraflow.ops.models import export
from tests.unit.test_export import save_checkpoint, trained_model

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None and not os.environ.get("CI"),
        reason="vllm not installed (make setup EXTRAS=dev,cpu)",
    ),
]
PROMPT = [5, 17, 42, 9]


async def test_vllm_serves_an_exported_checkpoint_as_transformers_runs_it(tiny_model, tmp_path):
    import torch

    from astraflow.engines.vllm import VLLMEngine

    model = trained_model(tiny_model)
    out = export(
        save_checkpoint(tmp_path / "ckpt", model, 4),
        Path(tiny_model),
        tmp_path / "hf",
        "float32",
    )
    with torch.no_grad():
        expected = model.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False)[0, len(PROMPT) :]
    engine = VLLMEngine(
        EngineSettings(type="vllm", model=str(out), dtype="float32"), log_path=tmp_path / "vllm.log"
    )
    await engine.start()
    try:
        got = await engine.generate(
            GenerateRequest(PROMPT, SamplingParams(temperature=0.0, max_new_tokens=8))
        )
    finally:
        await engine.close()
    assert got.token_ids == expected.tolist()[: len(got.token_ids)] and len(got.token_ids) > 0

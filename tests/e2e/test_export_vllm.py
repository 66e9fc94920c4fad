"""An exported checkpoint (`astraflow export`) served by the real vLLM engine: it generates what the
checkpoint's model generates, so the trained policy, not its starting weights, was loaded. LoRA: an
exported adapter and a version's half (a PEFT adapter directory whose weights file is the half's) load at
runtime as adapters; each request's tokens are sampled by, and tagged with, the adapter newest at its
start, with the logprobs `peft` computes; the older adapter is unloaded."""

import asyncio
import importlib.util
import os
from pathlib import Path

import pytest

from astraflow.engines.base import GenerateRequest, SamplingParams
from astraflow.engines.settings import EngineSettings, VLLMSettings
from astraflow.ops.models import export
from tests.unit.test_export import save_adapter_checkpoint, save_checkpoint, trained_adapter, trained_model

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


LORA_PROMPT = [5, 17, 42]


def half_of(model, root: Path) -> Path:
    """The adapter of `model` as a receiver's half holds it: `model.safetensors` in the served layout, and
    the adapter directory's files beside it (`weights.adapters`)."""
    import torch

    from astraflow.trainer import distributed, lora
    from astraflow.weights import adapters, layout
    from astraflow.weights.buffer import DoubleBuffer

    state = distributed.publication_state(model, torch.float32)
    half = DoubleBuffer(root, layout.layout(state, "float32")).write_state(state)
    adapters.make_adapter_dir(half.dir, lora.adapter_config(model), half.path.name)
    return half.dir


def first_logprob(model, token: int) -> float:
    import torch

    with torch.no_grad():
        logits = model.eval()(input_ids=torch.tensor([LORA_PROMPT])).logits[0, -1]
    return float(torch.log_softmax(logits.float(), -1)[token])


async def test_vllm_serves_each_version_as_a_runtime_adapter(tiny_model, tmp_path):
    import torch

    from astraflow.engines.vllm import VLLMEngine

    first = trained_adapter(tiny_model)
    ckpt = save_adapter_checkpoint(tmp_path / "ckpt", first, tiny_model)
    exported = export(ckpt, Path(tiny_model), tmp_path / "adapter", "float32")
    second = trained_adapter(tiny_model)
    with torch.no_grad():  # another version: the adapter moved again
        for p in second.parameters():
            if p.requires_grad:
                p.mul_(-1.5)
    settings = EngineSettings(
        type="vllm", model=tiny_model, dtype="float32", vllm=VLLMSettings(max_lora_rank=2)
    )
    engine = VLLMEngine(settings, log_path=tmp_path / "vllm.log")
    await engine.start()
    try:
        request = GenerateRequest(LORA_PROMPT, SamplingParams(max_new_tokens=4, seed=3))
        for version, (model, path) in enumerate(
            [(first, exported), (second, half_of(second, tmp_path / "h"))], 1
        ):
            await engine.pause()
            await engine.load_weights(str(path), version)
            await engine.resume()
            out = await engine.generate(request)
            assert out.versions == [version] * len(out.token_ids)
            assert abs(out.logprobs[0] - first_logprob(model, out.token_ids[0])) < 1e-4
        calls, sample = engine.stats["calls"], GenerateRequest(LORA_PROMPT, SamplingParams(max_new_tokens=4))
        group = await asyncio.gather(*[engine.generate(sample) for _ in range(8)])
        assert engine.stats["calls"] == calls + 1  # a prompt group's samples: one call, a completion each
        for out in group:
            assert out.versions == [2] * len(out.token_ids)
            assert abs(out.logprobs[0] - first_logprob(second, out.token_ids[0])) < 1e-4
        served = (await engine._ctl.get("/v1/models")).json()["data"]
        assert {m["id"] for m in served} == {"policy", "v2"}  # v1 unloaded: nothing generates with it
    finally:
        await engine.close()

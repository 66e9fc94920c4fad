"""LoRA versions through the weight manager and into the hf engine: the trainer publishes its adapter,
the manifest names the base's digest, a receiver that holds that base pulls it (full, then deltas) into a
half that `peft` loads as an adapter directory and the hf engine serves; a receiver holding other weights
refuses it before pulling a byte."""

from __future__ import annotations

import pytest
import torch

from astraflow.engines.base import GenerateRequest, SamplingParams
from astraflow.engines.hf import HFEngine
from astraflow.engines.settings import EngineSettings
from astraflow.errors import ForeignAdapterError
from astraflow.messages import WeightManifest, decode
from astraflow.trainer import distributed, lora
from astraflow.trainer.settings import LoraSettings
from astraflow.weights import adapters, layout
from astraflow.weights.published import run_secret
from astraflow.weights.publisher import Adapter, WeightPublisher
from astraflow.weights.receiver import WeightReceiver
from astraflow.weights.server import WeightServer
from astraflow.weights.settings import WeightsSettings

pytestmark = [pytest.mark.integration, pytest.mark.one_redis]
MODEL = "policy"


def adapter_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return lora.wrap(base, LoraSettings(rank=2, alpha=4, base_dtype="float32"))


def nudge(model, seed: int) -> None:
    """Move the adapter as an optimizer step would (B starts at zero: the adapter would be a no-op)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)


def receiver(bus, settings, secret, root, model_dir) -> WeightReceiver:
    return WeightReceiver(bus, settings, MODEL, root, secret, WeightServer(secret), model_dir=model_dir)


async def test_an_adapter_version_reaches_the_hf_engine_and_a_foreign_base_refuses_it(
    bus, tmp_path, tiny_model, tiny_model_v2
):
    from pathlib import Path

    settings = WeightsSettings(full_every=100, same_host=False)
    secret = await run_secret(bus, settings)
    model = adapter_model(tiny_model)
    state = distributed.publication_state(model, torch.bfloat16)
    full_bytes = sum(t.numel() for t in model.get_base_model().state_dict().values()) * 2
    adapter = Adapter(adapters.base_digest(tiny_model), lora.adapter_config(model))
    specs = layout.layout(state, "bfloat16")
    pub = WeightPublisher(bus, settings, MODEL, specs, tmp_path / "trainer", secret, adapter)
    rx = receiver(bus, settings, secret, tmp_path / "rx", Path(tiny_model))
    foreign = receiver(bus, settings, secret, tmp_path / "foreign", Path(tiny_model_v2))
    engine = HFEngine(EngineSettings(type="hf", model=tiny_model))
    await engine.start()
    try:
        for v in range(3):
            nudge(model, v)
            await pub.publish(state, v, step=v)
            await pub.wait()
            half = await rx.sync(bus.keys.weights(MODEL, v), v)
        assert (rx.stats["full_pulls"], rx.stats["delta_pulls"]) == (1, 2)
        manifest = decode(await bus.redis.hgetall(bus.keys.weights(MODEL, 2)), WeightManifest)
        assert manifest.adapter_of == adapters.base_digest(tiny_model)
        assert manifest.nbytes < 0.05 * full_bytes  # a version is a few percent of the weights

        # The half is a PEFT adapter directory holding exactly the trainer's adapter.
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
        loaded = PeftModel.from_pretrained(base, str(half.dir)).eval()
        ids = torch.tensor([[5, 17, 42, 9, 3]])
        with torch.no_grad():
            want = model.eval()(input_ids=ids).logits
            got = loaded(input_ids=ids).logits
        assert (got - want).abs().max() < 0.05  # bf16-served adapter

        # The hf engine serves it: its first token's logprob is the adapter model's.
        await engine.pause()
        await engine.load_weights(str(half.dir), 2)
        await engine.resume()
        resp = await engine.generate(GenerateRequest([5, 17, 42], SamplingParams(max_new_tokens=1, seed=1)))
        with torch.no_grad():
            logp = torch.log_softmax(loaded(input_ids=torch.tensor([[5, 17, 42]])).logits[0, -1], -1)
        assert resp.versions == [2]
        assert abs(resp.logprobs[0] - float(logp[resp.token_ids[0]])) < 1e-4

        # Other base weights: refused before any pull, and nothing is served.
        with pytest.raises(ForeignAdapterError, match="an adapter of base"):
            await foreign.sync(bus.keys.weights(MODEL, 2), 2)
        assert foreign.buffer is None and foreign.stats["foreign_adapters"] == 1
    finally:
        await engine.close()
        await pub.close()
        for r in (rx, foreign):
            r.close()
            r.server.close()

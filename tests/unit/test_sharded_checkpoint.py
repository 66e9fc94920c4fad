"""A model saved in shards (the usual 7B checkpoint: `model.safetensors.index.json` beside its shards)
is served like any other: a half of the double buffer, one `model.safetensors` plus the model's config
files, loads in transformers and in the hf engine with the model's own weights."""

from pathlib import Path

import torch

from astraflow.engines.settings import EngineSettings
from astraflow.weights import files
from tests.conftest import served_half

NAME = "model.layers.1.mlp.down_proj.weight"


async def test_a_half_of_a_sharded_model_loads_with_its_weights(tiny_model_sharded, tmp_path):
    from transformers import AutoModelForCausalLM

    from astraflow.engines.hf import HFEngine

    copied = files.checkpoint_files(Path(tiny_model_sharded))
    assert "config.json" in copied and not any(name.endswith(".index.json") for name in copied)
    want = AutoModelForCausalLM.from_pretrained(tiny_model_sharded, dtype=torch.bfloat16).state_dict()[NAME]

    half = served_half(tiny_model_sharded, tmp_path / "buffers")
    loaded = AutoModelForCausalLM.from_pretrained(half, dtype=torch.bfloat16)
    assert torch.equal(loaded.state_dict()[NAME], want)

    engine = HFEngine(EngineSettings(type="hf", model=tiny_model_sharded, dtype="bfloat16"))
    await engine.start()  # from the shards
    try:
        assert torch.equal(engine.model.state_dict()[NAME], want)
        with torch.no_grad():
            engine.model.state_dict()[NAME].zero_()
        await engine.pause()
        await engine.load_weights(str(half), version=1)
        await engine.resume()
        assert torch.equal(engine.model.state_dict()[NAME], want)
    finally:
        await engine.close()

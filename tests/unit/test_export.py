"""`astraflow export`: a checkpoint saved as the trainer saves it becomes a Hugging Face directory that
transformers loads with the same logits as the model the checkpoint was made from."""

from __future__ import annotations

from pathlib import Path

import pytest

from astraflow.cli import main
from astraflow.errors import ConfigError

torch = pytest.importorskip("torch")


def trained_model(tiny_model: str):
    """The tiny model with weights moved off its starting point (as a training step would)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def save_checkpoint(root, model, version: int):
    from astraflow.trainer import checkpoint

    state = checkpoint.TrainerState(version=version, step=version, run="0123456789ab")
    rng = [checkpoint.rng_state(torch.device("cpu"))]
    return checkpoint.save(root, state, model.state_dict(), {}, {}, rng, keep=2)


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_an_exported_checkpoint_loads_in_transformers_with_equal_logits(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = trained_model(tiny_model)
    root = tmp_path / "run" / "checkpoints" / "policy"
    save_checkpoint(root, model, 3)
    sets = ["--set", f"trainer.model={tiny_model}", "--set", f"run.dir={tmp_path / 'run'}"]
    out = tmp_path / "hf"
    assert main(["export", str(out), "--version", "3", "--dtype", "float32", *sets]) == 0

    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = torch.tensor([tokenizer("12+34=46")["input_ids"]])
    assert torch.equal(logits(loaded, ids), logits(model, ids))
    assert (
        tokenizer("12+34=")["input_ids"] == AutoTokenizer.from_pretrained(tiny_model)("12+34=")["input_ids"]
    )
    base = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    assert not torch.equal(logits(base, ids), logits(loaded, ids))  # the checkpoint's weights, not the base's


def test_a_bf16_export_holds_bf16_weights_close_to_the_checkpoint(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    from astraflow.ops.models import export

    model = trained_model(tiny_model)
    ckpt = save_checkpoint(tmp_path / "ckpt", model, 1)
    out = export(ckpt, Path(tiny_model), tmp_path / "hf", "bfloat16")
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert loaded.dtype == torch.bfloat16 and loaded.config.dtype == torch.bfloat16
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.allclose(logits(loaded.float(), ids), logits(model, ids), atol=0.1)


def test_a_version_without_checkpoint_is_one_line_with_the_versions_there(tiny_model, tmp_path, capsys):
    save_checkpoint(tmp_path / "run" / "checkpoints" / "policy", trained_model(tiny_model), 2)
    sets = ["--set", f"trainer.model={tiny_model}", "--set", f"run.dir={tmp_path / 'run'}"]
    capsys.readouterr()  # (loading the model above drew a progress bar)
    assert main(["export", str(tmp_path / "hf"), "--version", "5", *sets]) == 1
    err = capsys.readouterr().err
    assert "no checkpoint of version 5" in err and "(have: [2])" in err and len(err.splitlines()) == 1


def test_an_existing_directory_is_never_overwritten(tiny_model, tmp_path):
    from astraflow.ops.models import export

    ckpt = save_checkpoint(tmp_path / "ckpt", trained_model(tiny_model), 1)
    out = tmp_path / "kept"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not empty"):
        export(ckpt, Path(tiny_model), out)
    assert (out / "notes.txt").read_text() == "mine"


def test_export_of_a_run_reads_the_settings_astraflow_run_saved(tiny_model, tmp_path, monkeypatch):
    """`astraflow export --run NAME --version V OUT` after `astraflow run`: no recipe, no flags."""
    from transformers import AutoModelForCausalLM

    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "runs" / "demo"
    run_dir.mkdir(parents=True)
    (run_dir / "settings.yaml").write_text(f"run: {{name: demo}}\ntrainer: {{model: {tiny_model}}}\n")
    model = trained_model(tiny_model)
    save_checkpoint(run_dir / "checkpoints" / "policy", model, 7)
    assert main(["export", "--run", "demo", "--version", "7", "--dtype", "float32", "out"]) == 0
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    assert torch.equal(
        logits(AutoModelForCausalLM.from_pretrained(tmp_path / "out"), ids), logits(model, ids)
    )


def trained_adapter(tiny_model: str):
    """A LoRA policy of the tiny model with its adapter moved off zero (as training would)."""
    from transformers import AutoModelForCausalLM

    from astraflow.trainer import lora
    from astraflow.trainer.settings import LoraSettings

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    model = lora.wrap(base, LoraSettings(rank=2, alpha=4, base_dtype="float32")).eval()
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    return model


def save_adapter_checkpoint(root, model, model_dir: str):
    """A LoRA trainer's checkpoint of `model`: its adapter, the base's digest and the adapter config."""
    from astraflow.trainer import checkpoint, distributed, lora
    from astraflow.weights.adapters import base_digest

    state = checkpoint.TrainerState(1, 1, run="0123456789ab", base=base_digest(model_dir))
    state.adapter_config = lora.adapter_config(model)
    rng = [checkpoint.rng_state(torch.device("cpu"))]
    return checkpoint.save(root, state, distributed.full_model_state(model), {}, {}, rng, keep=2)


def test_a_lora_checkpoint_exports_as_its_adapter_or_merged(tiny_model, tiny_model_v2, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from astraflow.ops.models import export

    model = trained_adapter(tiny_model)
    ckpt = save_adapter_checkpoint(tmp_path / "ckpt", model, tiny_model)
    ids = torch.tensor([[5, 17, 42, 9, 3]])
    out = export(ckpt, Path(tiny_model), tmp_path / "adapter", "float32")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {f.name for f in out.iterdir()}
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, str(out)).eval()
    assert torch.allclose(logits(loaded, ids), logits(model, ids), atol=1e-5)
    merged = AutoModelForCausalLM.from_pretrained(
        export(ckpt, Path(tiny_model), tmp_path / "merged", "float32", merge=True)
    ).eval()
    assert torch.allclose(logits(merged, ids), logits(model, ids), atol=1e-4)
    with pytest.raises(ConfigError, match="an adapter of other weights"):
        export(ckpt, Path(tiny_model_v2), tmp_path / "other", "float32")

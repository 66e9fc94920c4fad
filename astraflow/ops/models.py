"""Model directories an operator makes: `astraflow export`, a trainer checkpoint as a Hugging Face
`save_pretrained` directory, and `astraflow model tiny` (`tiny`).

A checkpoint (`trainer.checkpoint`) holds the weights alone (`model.pt`, the model's state dict in
float32). The export puts them into the policy's architecture (`config.json` of its model directory),
in bfloat16 or float32, and copies the directory's tokenizer and other non-weight files beside them, so
`AutoModelForCausalLM.from_pretrained`, `AutoTokenizer.from_pretrained` and vLLM load the trained policy
as they load the model it started from. `astraflow.json` records where the weights came from.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Literal

from astraflow import tiny
from astraflow.errors import ConfigError
from astraflow.launch.tiny_cache import warm_start_progress
from astraflow.ops.context import settings_from

Dtype = Literal["bfloat16", "float32"]
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5", ".ckpt", ".gguf")
"""Files of a model directory that hold weights (or index them): never copied into an export."""
MARKER = "astraflow.json"


def checkpoint_dir(root: Path, version: int | None) -> Path:
    """The durable checkpoint `v<version>` under `root` (default: the newest)."""
    from astraflow.trainer import checkpoint

    if version is None:
        found = checkpoint.latest(root)
        if found is None:
            raise ConfigError(
                f"no checkpoint in {root}: has the trainer saved one (trainer.checkpoint_every)?"
            )
        return found
    path = root / f"v{version:08d}"
    if not (path / checkpoint.META).exists():
        have = sorted(int(p.name[1:]) for p in root.glob("v*") if (p / checkpoint.META).exists())
        raise ConfigError(f"no checkpoint of version {version} in {root} (have: {have or 'none'})")
    return path


def export(
    checkpoint: Path, model_dir: Path, out: Path, dtype: Dtype = "bfloat16", merge: bool = False
) -> Path:
    """Write `out` (created; an existing non-empty directory is refused) from the checkpoint directory
    `checkpoint` and the policy's model directory `model_dir` (its config and tokenizer). A LoRA
    checkpoint (an adapter of `model_dir`'s weights, refused for other weights) is written as the PEFT
    adapter (`adapter_config.json`, `adapter_model.safetensors`), or with `merge` merged into the base."""
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out}: exists and is not empty; export into a new directory")
    if not (model_dir / "config.json").exists():
        raise ConfigError(
            f"{model_dir}: no config.json (the policy's model directory gives the architecture)"
        )
    meta = json.loads((checkpoint / "meta.json").read_text())
    model = _trained(checkpoint, model_dir, meta)
    adapter = bool(meta.get("base"))
    if adapter and merge:
        model = model.merge_and_unload()
    model.to(_torch_dtype(dtype))
    out.mkdir(parents=True, exist_ok=True)
    if not adapter or merge:
        for f in model_dir.iterdir():  # the tokenizer, chat template, generation config, README, ...
            if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES) and not f.name.endswith(".index.json"):
                shutil.copy2(f, out / f.name)
    model.save_pretrained(out)  # config.json (with the dtype) and model.safetensors, or the adapter's files
    record = {"checkpoint": str(checkpoint.resolve()), "model_dir": str(model_dir.resolve()), "dtype": dtype}
    kind = {"kind": "merged" if merge else "adapter", "base": meta["base"]} if adapter else {}
    (out / MARKER).write_text(
        json.dumps({**record, **kind, "version": meta["version"], "step": meta["step"]}, indent=2)
    )
    return out


def _torch_dtype(dtype: Dtype):
    import torch

    return getattr(torch, dtype)


def _trained(checkpoint: Path, model_dir: Path, meta: dict):
    """The checkpoint's policy in float32: the model with its weights, or (LoRA) the base of `model_dir`
    wrapped by `peft` with the checkpoint's adapter. ConfigError when they do not fit."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    state = torch.load(checkpoint / "model.pt", weights_only=True, map_location="cpu")
    if meta.get("base"):
        from peft import PeftConfig, get_peft_model

        from astraflow.weights.adapters import base_digest

        if base_digest(str(model_dir)) != meta["base"]:
            raise ConfigError(
                f"{checkpoint}: an adapter of other weights than {model_dir}'s: export with the base the"
                " policy started from (--model-dir)"
            )
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model = get_peft_model(base, PeftConfig.from_peft_type(**json.loads(meta["adapter_config"])))
        _, unexpected = model.load_state_dict(state, strict=False)
        if unexpected or any(k not in state for k, p in model.named_parameters() if p.requires_grad):
            raise ConfigError(f"{checkpoint}: its adapter does not fit its own adapter config")
        return model
    config = AutoConfig.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(
        getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None) or []
    )
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise ConfigError(
            f"{checkpoint}: its weights do not fit {model_dir}'s architecture "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]}): export with the policy's own model"
        )
    model.tie_weights()
    return model


def cmd_export(args) -> int:
    """`astraflow export [RECIPE] OUT`: a checkpoint of the run (`--run`, `--version`, `--model`) or the
    directory `--checkpoint`, with the policy's model directory from the recipe, else from the settings
    `astraflow run` saved in the run directory (`runs/<name>/settings.yaml`), else `--model-dir`."""
    saved = Path("runs") / (args.run or "") / "settings.yaml"
    if args.recipe is None and args.run and saved.exists():
        args.recipe = str(saved)
    settings = settings_from(args)
    name = args.model or settings.trained[0]
    policy = settings.policy(name)
    if args.checkpoint:
        ckpt = Path(args.checkpoint)
        if not (ckpt / "meta.json").exists():
            raise ConfigError(f"--checkpoint {ckpt}: not a checkpoint directory (no meta.json)")
    else:
        root = policy.trainer.checkpoint_dir or settings.run.path / "checkpoints" / name
        ckpt = checkpoint_dir(root, args.version)
    source = args.model_dir or policy.trainer.model
    if not source:
        raise ConfigError(f"--model-dir: policy {name!r} names no model directory (its config and tokenizer)")
    model_dir = Path(source)
    out = export(ckpt, model_dir, Path(args.out), args.dtype, args.merge)
    if (out / "adapter_config.json").exists():
        load = f"PeftModel.from_pretrained(<{model_dir}>, {str(out)!r})"
    else:
        load = f"AutoModelForCausalLM.from_pretrained({str(out)!r})"
    print(f"exported {ckpt} ({args.dtype}) to {out}: {load}")
    return 0


def cmd_model_tiny(args) -> int:
    """`astraflow model tiny OUT`: a tiny Qwen2 model and tokenizer, optionally warm-started."""
    out = tiny.build(args.out_dir, seed=args.seed)
    print(f"built {out}")
    if args.warm_start:
        progress = warm_start_progress(args.steps)
        loss = tiny.warm_start(out, args.warm_start, steps=args.steps, seed=args.seed, on_step=progress)
        print(f"warm start on {args.warm_start}: {args.steps} steps, final loss {loss:.3f}")
    return 0

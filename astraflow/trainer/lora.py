"""A LoRA policy through `peft`: the base frozen (in `lora.base_dtype`), the adapter trained in float32.

Two views of the adapter leave the trainer. A version is the adapter as PEFT saves it
(`adapter_state`: `get_peft_model_state_dict`'s names, which an `adapter_model.safetensors` holds and
both engines load) with its `adapter_config.json` (`adapter_config`). A checkpoint holds the trainable
parameters under the model's own names (`trainable_names`), which `load_state_dict` and FSDP2's state-dict
helpers take back, and their optimizer state only.
"""

from __future__ import annotations

import json

from astraflow.errors import ForeignCheckpointError
from astraflow.trainer import devices
from astraflow.trainer.settings import LoraSettings


def wrap(model, settings: LoraSettings):
    """`model` (a causal LM) with a fresh LoRA adapter: the base cast to `base_dtype` and frozen, the
    adapter's parameters float32 (PEFT's initialisation: B = 0, so version 0 is the base itself)."""
    from peft import LoraConfig, get_peft_model

    model.to(devices.DTYPES[settings.base_dtype])
    config = LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config, autocast_adapter_dtype=True)


def is_adapter(model) -> bool:
    """Whether `model` is a PEFT model (`wrap`)."""
    return hasattr(model, "peft_config")


def decoder_layers(model):
    """The decoder layers of a causal LM, through a PEFT wrapper when there is one."""
    base = model.get_base_model() if is_adapter(model) else model
    return base.model.layers


def adapter_state(model, state: dict | None = None) -> dict:
    """The adapter's tensors under PEFT's saved names (`...q_proj.lora_A.weight`), the live tensors (no
    copy), from `state` (the model's state dict, DTensors when sharded) or the model's own."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model, state_dict=state)


def adapter_config(model) -> str:
    """The adapter's `adapter_config.json` text, naming no base path (the manifest names its digest)."""
    config = model.peft_config["default"].to_dict()
    config["base_model_name_or_path"] = None
    config["target_modules"] = sorted(config["target_modules"])  # a set: JSON has none
    return json.dumps(config, sort_keys=True, default=str)


def trainable_names(model) -> set[str]:
    """Names of the parameters the optimizer holds (the adapter's, under the model's own names)."""
    return {name for name, p in model.named_parameters() if p.requires_grad}


def check_restorable(model, state: dict) -> None:
    """Raise ForeignCheckpointError unless `state` holds exactly this adapter's parameters (a checkpoint of
    another rank or other target modules would load half, or not at all)."""
    want, have = trainable_names(model), set(state)
    if want != have:
        raise ForeignCheckpointError(
            f"the checkpoint's adapter differs from trainer.lora: missing {sorted(want - have)[:4]}, "
            f"unexpected {sorted(have - want)[:4]}"
        )

"""Policies of a run: what a recipe says about each (`run.models.<name>`) and what that policy gets.

A policy's engine and trainer settings are the shared top-level `engine` and `trainer` sections with the
policy's own sections deep-merged over them: a policy overrides only the fields it sets. Every consumer
reads a policy's settings through `Settings.policy(name)`, never the shared sections.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from astraflow.engines.settings import EngineSettings, unreproducible
from astraflow.errors import RuleError
from astraflow.local_files import dataset_problem, model_problem
from astraflow.trainer.settings import TrainerSettings

if TYPE_CHECKING:
    from astraflow.config import Settings


class PolicySpec(BaseModel):
    """One entry of `run.models`, as the recipe writes it."""

    model_config = ConfigDict(extra="forbid")

    model: str = ""
    """Starting weights of this policy (a Hugging Face directory or hub id; for an `openai` engine, the
    served model name); default `engine.model` / `trainer.model`, else the `run.tiny` model."""
    train: bool = True
    """Trained in this run (its own `batches:<name>` stream and trainer); `false` for a policy that only
    serves (a judge, a frozen opponent)."""
    engine: dict[str, Any] = Field(default_factory=dict)
    """Fields of `engine` this policy sets differently (e.g. `type: openai`, `devices: "1"`)."""
    trainer: dict[str, Any] = Field(default_factory=dict)
    """Fields of `trainer` this policy sets differently (not `mode`: lockstep is run-wide)."""


class PolicySettings(BaseModel):
    """The effective settings of one policy: what its engines and its trainer are built from."""

    model_config = ConfigDict(frozen=True)

    name: str
    train: bool
    engine: EngineSettings
    trainer: TrainerSettings


def deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with `over`'s values in its place; mappings present in both are merged the same way."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def effective(
    name: str, spec: PolicySpec, engine: EngineSettings, trainer: TrainerSettings, tiny: Path | None
) -> PolicySettings:
    """The settings policy `name` runs with. Starting weights, most specific first: the policy's own
    section, its `model`, the shared section, the tiny model; the trainer's default is the engine's. A
    LoRA trainer (`trainer.lora`) sets its engine's `vllm.max_lora_rank` to the adapter's rank."""
    if "mode" in spec.trainer:
        raise RuleError(f"run.models.{name}.trainer.mode", "trainer.mode is run-wide: set it in `trainer`")
    sections = {}
    for section, shared in (("engine", engine), ("trainer", trainer)):
        data = deep_merge(shared.model_dump(), getattr(spec, section))
        try:
            sections[section] = type(shared).model_validate(data)
        except ValidationError as e:
            problem = e.errors()[0]
            loc = ".".join(str(p) for p in problem["loc"])
            raise RuleError(f"run.models.{name}.{section}.{loc}", problem["msg"]) from None
    e, t = sections["engine"], sections["trainer"]
    if t.lora is not None and not e.vllm.max_lora_rank:  # its versions are adapters of this rank
        e.vllm.max_lora_rank = t.lora.rank
    e_model = spec.engine.get("model") or spec.model or engine.model or str(tiny or "")
    t_model = spec.trainer.get("model") or spec.model or trainer.model or e_model
    return PolicySettings(
        name=name,
        train=spec.train,
        engine=e.model_copy(update={"model": e_model}),
        trainer=t.model_copy(update={"model": t_model}),
    )


def engine_field(name: str, spec: PolicySpec) -> str:
    """Where policy `name`'s engine settings come from: its own section where it has one, else `engine`."""
    return f"run.models.{name}.engine" if spec.engine else "engine"


def model_field(name: str, spec: PolicySpec, section: str) -> str:
    """The setting a policy's `section` (engine or trainer) took its starting weights from."""
    if getattr(spec, section).get("model"):
        return f"run.models.{name}.{section}.model"
    return f"run.models.{name}.model" if spec.model else f"{section}.model"


TWO_POLICY_WORKFLOWS = {
    "solve_and_verify": "a solver and a verifier",
    "route": "a small one and a large one to hand off to",
}


def check_policies(settings: Settings, policies: list[PolicySettings]) -> None:
    """The rules about the run's policies (`policies`: their effective settings); raises `RuleError`."""
    models = settings.run.models
    if not any(p.train for p in policies):
        raise RuleError("run.models", "no policy is trained (every one has train: false)")
    tiny = str(settings.run.tiny.path) if settings.run.tiny is not None else None  # built before it is used
    for p in policies:
        for section, used in (("engine", p.engine.type != "openai"), ("trainer", p.train)):
            path = getattr(p, section).model
            problem = model_problem(path) if used and path != tiny else None
            if problem is not None:
                raise RuleError(model_field(p.name, models[p.name], section), problem)
    for p in policies:
        problem = unreproducible(p.engine) if p.train else None
        if problem is not None:
            raise RuleError(
                engine_field(p.name, models[p.name]),
                f"a trained policy's tokens must be scored as sampled, and the trainer cannot: {problem}",
            )
    for option, value in settings.raas.workflow_options.items():
        if option.endswith("_model") and value not in models:
            raise RuleError(f"raas.workflow_options.{option}", f"names no policy of run.models: {value!r}")
    roles = TWO_POLICY_WORKFLOWS.get(settings.dataflow.feeder.workflow)
    if roles and len(models) < 2:
        raise RuleError("run.models", f"{settings.dataflow.feeder.workflow} needs two policies: {roles}")


def check_datasets(settings: Settings) -> None:
    """The datasets the run reads (training and eval) are where their paths say; raises `RuleError`."""
    named = [("dataflow.dataset", settings.dataflow.dataset)]
    named += [(f"eval.datasets.{i}.dataset", d.dataset) for i, d in enumerate(settings.eval.datasets)]
    for field, dataset in named:
        problem = dataset_problem(dataset)
        if problem is not None:
            raise RuleError(f"{field}.path", problem)

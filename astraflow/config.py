"""The root settings model: the sections of a run, composed from recipe data, `ASTRAFLOW_...` env vars and
`--set` overrides, and the rules that span sections (model validators).

Precedence (highest first): `--set section.key=value`, env `ASTRAFLOW_SECTION__KEY`, the recipe file,
the defaults on the fields (`Settings.compose`). Finding and reading a recipe, parsing `--set`, naming
where a bad value came from and handing the settings to a child process are `settings_load`'s; secrets
never appear in `redacted()`.
"""

from __future__ import annotations

import hashlib
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from astraflow import layout
from astraflow.dataflow.evaluation import EvalSettings
from astraflow.dataflow.settings import DataflowSettings
from astraflow.engines.settings import EngineSettings
from astraflow.errors import ConfigError, RuleError
from astraflow.layout import LayoutSettings
from astraflow.policies import (
    PolicySettings,
    PolicySpec,
    check_datasets,
    check_policies,
    effective,
)
from astraflow.raas.settings import RaasSettings
from astraflow.streams.settings import RedisSettings, StreamsSettings
from astraflow.tracking.settings import TrackingSettings
from astraflow.trainer.settings import TrainerSettings
from astraflow.weights.settings import WeightsSettings

ENV_PREFIX = "ASTRAFLOW_"
TINY_CACHE = Path("runs") / ".cache"


class TinyModelSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tokenizer: Literal["char", "char_calc", "char_agent", "bpe"] = "char"
    """char: digits, `+`, `=`; char_calc: those and the calculator tool's `*-<>|`; char_agent: those and chat
    words with Hermes-style tool calls (`tiny.AGENT_WORDS`); bpe: a 512-token BPE."""
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 4
    intermediate: int = 512
    warm_start_task: str | None = "addition"
    warm_start_steps: int = Field(300, ge=0)
    seed: int = 0

    @property
    def path(self) -> Path:
        """Where this configuration's model is built (once; `launch.tiny_cache.build_tiny`), absolute."""
        key = hashlib.sha1(self.model_dump_json().encode()).hexdigest()[:12]
        return (TINY_CACHE / f"tiny-{self.tokenizer}-{key}").resolve()


class RunSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field("demo", pattern=r"^[A-Za-z0-9._-]{1,64}$")
    """Run name; every Redis key of the run starts with `af:{name}:`. Letters, digits, `.`, `_`, `-`: the
    name goes into SCAN and ACL key patterns, where `*`, `?` or `[` would reach other runs' keys, and into
    the run directory `runs/<name>`, where `.` or `..` would name another directory."""
    dir: Path | None = None
    """Run directory (logs, embedded Redis, checkpoints); default `runs/<name>`."""
    seed: int = 0
    models: dict[str, PolicySpec] = Field(default_factory=lambda: {"policy": PolicySpec()}, min_length=1)
    """The run's policies by name, each with its own starting weights, `engine` and `trainer` fields over
    the shared sections, and whether it is trained (`train`). A list of names is the same with defaults."""
    kind: Literal["train", "demo"] = "train"
    """What `astraflow run` runs: the training loop, or the bus demo."""
    raas_workers: int = Field(1, ge=1)
    """RaaS worker processes `astraflow run` starts."""
    target_reward: float | None = 0.8
    """The run stops once every model's moving-average reward reaches this (`astraflow run`, or the
    dataflow and trainer of workers started on their own: `launch.stops`)."""
    reward_window: int = Field(10, ge=1)
    """Trainer steps in the moving average."""
    max_steps: int | None = Field(None, ge=1)
    """The run stops after this many versions of every model."""
    max_time_s: float | None = Field(None, gt=0)
    """The run stops this long after it was created."""
    stop_after_dead_groups: int | None = Field(64, ge=1)
    """`astraflow run` stops the run (exit 5) once this many prompt groups in a row were dead-lettered
    with none collected between: nothing it could train on is coming (a broken reward, workflow or
    engine). None: it waits for them."""
    supervised: bool = False
    """Set by `astraflow run` on the workers it starts: it judges the stop conditions and stops them
    itself. A worker started on its own (False) judges them and follows the run's stop notice."""
    max_restarts: int = Field(5, ge=0)
    """`astraflow run` restarts a worker that dies at most this many times within `restart_window_s`;
    one more death in that window stops the run (with its report)."""
    restart_window_s: float = Field(600.0, gt=0)
    """The window of the restart budget: a worker that crashes now and then over a long run is
    restarted each time."""
    tiny: TinyModelSettings | None = None
    """Build this tiny model (cached): the starting weights of every policy that names none."""

    @model_validator(mode="before")
    @classmethod
    def _no_eval_every_s(cls, value: Any) -> Any:
        if isinstance(value, dict) and "eval_every_s" in value:
            raise ValueError("run.eval_every_s is gone: set eval.every_s (or eval.every) and eval.datasets")
        return value

    @field_validator("name")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        if set(value) == {"."}:
            raise ValueError(f"run.name {value!r} names a directory around the run's: choose a plain name")
        return value

    @field_validator("models", mode="before")
    @classmethod
    def _names_are_policies(cls, value: Any) -> Any:
        if isinstance(value, list | tuple):
            return {str(name): {} for name in value}
        if isinstance(value, dict):
            return {name: spec if spec is not None else {} for name, spec in value.items()}
        return value

    @property
    def path(self) -> Path:
        return self.dir if self.dir is not None else Path("runs") / self.name


class LogSettings(BaseModel):
    """Logging (`logs.configure`; its settings live here, so that `astraflow --help` needs no pydantic)."""

    model_config = ConfigDict(extra="forbid")

    level: Literal["debug", "info", "warning", "error"] = "info"
    """The least severe event a worker process logs (`astraflow run`'s own view logs warnings only)."""


class DemoSettings(BaseModel):
    """The bus demo (`recipes/bus-demo.yaml`, `run.kind: demo`): the bus alone, with a worker killed."""

    model_config = ConfigDict(extra="forbid")

    groups: int = Field(300, ge=1)
    """Prompt groups the demo feeder submits."""
    workers: int = Field(3, ge=1)
    """Consumer processes of `prompts`."""
    episode_ms: int = Field(30, ge=0)
    """Simulated work per entry."""
    kill_one: bool = True
    """`kill -9` one worker halfway to show its entries being reclaimed."""


_recipe_data: ContextVar[dict[str, Any] | None] = ContextVar("_recipe_data", default=None)


class _RecipeSource(PydanticBaseSettingsSource):
    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return (_recipe_data.get() or {}).get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(_recipe_data.get() or {})


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        extra="forbid",
        nested_model_default_partial_update=True,
    )

    run: RunSettings = Field(default_factory=RunSettings)
    redis: RedisSettings = Field(default_factory=RedisSettings)
    streams: StreamsSettings = Field(default_factory=StreamsSettings)
    dataflow: DataflowSettings = Field(default_factory=DataflowSettings)
    raas: RaasSettings = Field(default_factory=RaasSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    trainer: TrainerSettings = Field(default_factory=TrainerSettings)
    weights: WeightsSettings = Field(default_factory=WeightsSettings)
    demo: DemoSettings = Field(default_factory=DemoSettings)
    eval: EvalSettings = Field(default_factory=EvalSettings)
    """Evaluation as a service: datasets scored at every `eval.every`-th version (or `eval.every_s` seconds),
    for every policy."""
    tracking: TrackingSettings = Field(default_factory=TrackingSettings)
    """Experiment trackers (TensorBoard, W&B, MLflow) fed from the run's metrics stream."""
    log: LogSettings = Field(default_factory=LogSettings)
    """Logging: JSON lines when not on a terminal, at `log.level`."""
    layout: LayoutSettings = Field(default_factory=LayoutSettings)
    """One node's GPUs for `astraflow run`: the trainer's ranks and the RaaS engines (`astraflow.layout`)."""

    @model_validator(mode="after")
    def _rules(self) -> Settings:
        """Rules across sections, so every process sees the same effective settings."""
        if self.trainer.mode == "sync":  # lockstep: every group from the current weights
            self.dataflow.max_staleness_steps = 0
        check_policies(self, [self.policy(name) for name in self.run.models])
        check_datasets(self)
        if self.dataflow.feeder.workflow == "agent" and not self.raas.openai_api:
            raise RuleError(
                "raas.openai_api", "workflow agent runs programs against the RaaS's endpoint: set it true"
            )
        self._lay_out()
        return self

    def _lay_out(self) -> None:
        """`layout` applied: resolved (`auto` counted here, once; the children get the count), the RaaS
        workers one per engine, tensor parallel as wide as an engine's GPUs."""
        if self.layout.gpus == 0:
            return
        self.layout = layout.resolve(self.layout)
        engines = layout.plan(self.layout).engines
        if len(self.trained) != 1:
            raise RuleError("layout", f"lays out one trained policy, this run trains {len(self.trained)}")
        if self.layout.engine_gpus > 1 and self.engine.type == "hf":
            raise RuleError("layout.engine_gpus", "the hf engine runs on one GPU: tensor parallel needs vllm")
        self.run.raas_workers = len(engines)
        self.engine.vllm.tensor_parallel_size = self.layout.engine_gpus

    def policy(self, name: str) -> PolicySettings:
        """The effective settings of policy `name`: the shared `engine`/`trainer` with its own over them."""
        try:
            spec = self.run.models[name]
        except KeyError:
            raise ConfigError(f"run.models: no policy {name!r} (have {', '.join(self.run.models)})") from None
        tiny = self.run.tiny.path if self.run.tiny is not None else None
        return effective(name, spec, self.engine, self.trainer, tiny)

    @property
    def trained(self) -> list[str]:
        """The policies trained in this run: each has a `batches:<name>` stream and a trainer."""
        return [name for name, spec in self.run.models.items() if spec.train]

    @classmethod
    def settings_customise_sources(
        cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings
    ):  # type: ignore[override]
        return (init_settings, env_settings, _RecipeSource(settings_cls))

    @classmethod
    def compose(cls, recipe: dict[str, Any], overrides: dict[str, Any]) -> Settings:
        """The settings from `recipe` (its sections as plain data), the environment over it and `overrides`
        (nested, as `--set` gives them) over both; raises pydantic's ValidationError."""
        token = _recipe_data.set(recipe)
        try:
            return cls(**overrides)
        finally:
            _recipe_data.reset(token)

    @property
    def named_code(self) -> frozenset[str]:
        """The `module:Name` code this recipe names, the only code a prompt group may pick by name."""
        option = self.raas.workflow_options.get("reward")
        named = {self.dataflow.feeder.workflow, *([option] if isinstance(option, str) else [])}
        return frozenset({*self.raas.allowed_code, *(n for n in named if ":" in n)})

    def redacted(self) -> dict[str, Any]:
        """The settings as plain data with every secret masked (also a password inside a Redis URL)."""
        data = self.model_dump(mode="json")
        for field in ("url", "replica_url"):
            if getattr(self.redis, field, None):
                data["redis"][field] = redact_url(getattr(self.redis, field))
        data["policies"] = {name: self.policy(name).model_dump(mode="json") for name in self.run.models}
        return data


def redact_url(url: str) -> str:
    """`url` with its password (in the authority or a `password=` query parameter) replaced by `***`."""
    parts = urlsplit(url)
    if parts.password is not None:
        parts = parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@", 1))
    query = [(k, "***" if k == "password" else v) for k, v in parse_qsl(parts.query, keep_blank_values=True)]
    return urlunsplit(parts._replace(query=urlencode(query, safe="*")))

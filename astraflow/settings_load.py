"""The settings' way into a process and out to its children: the recipe a name or path means, the
recipe file read, `--set section.key=value` parsed, the whole composed by `config.Settings`
(`load_settings`), and env vars that reproduce the settings in a child process (`to_env`).

A bad value raises ConfigError with one line per problem naming the field and where its value came from
(`--set`, the env var, the recipe or the defaults), never the value itself.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import SecretStr, ValidationError

from astraflow.config import ENV_PREFIX, Settings
from astraflow.errors import ConfigError, RuleError


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """`["streams.lease_ms=500", ...]` -> nested dict; values parsed as YAML scalars."""
    out: dict[str, Any] = {}
    for pair in pairs:
        path, sep, raw = pair.partition("=")
        if not sep or not path:
            raise ConfigError(f"--set {pair!r}: expected section.key=value")
        node = out
        *parents, leaf = path.split(".")
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = yaml.safe_load(raw) if raw else ""
    return out


SHIPPED = Path(__file__).parent / "recipes"
"""The recipes installed with the package (the repository's `recipes/`)."""


def recipe_path(recipe: str | Path) -> Path:
    """The recipe file `recipe` names: that path when it exists, else the shipped recipe of that name
    (`addition-tiny`, `addition-tiny.yaml`, or `recipes/addition-tiny.yaml` run outside the repository)."""
    path = Path(recipe)
    if path.exists() or not (len(path.parts) == 1 or path.parent == Path("recipes")):
        return path
    name = path.name if path.suffix in (".yaml", ".yml") else f"{path.name}.yaml"
    return SHIPPED / name if (SHIPPED / name).is_file() else path


def shipped() -> list[str]:
    """The names of the shipped recipes."""
    return sorted(p.stem for p in SHIPPED.glob("*.yaml"))


def load_settings(recipe: str | Path | None = None, overrides: list[str] | None = None) -> Settings:
    """Build the settings from a recipe file, the environment and `--set` overrides."""
    data: dict[str, Any] = {}
    if recipe is not None:
        path = recipe_path(recipe)
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except OSError as e:
            raise ConfigError(f"{path}: cannot read recipe: {e} (shipped: {', '.join(shipped())})") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: cannot read recipe: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: a recipe is a mapping of sections, got {type(data).__name__}")
    cli = parse_overrides(overrides or [])
    try:
        return Settings.compose(data, cli)
    except ValidationError as e:
        raise ConfigError(_describe(e, recipe, cli)) from None


def _describe(err: ValidationError, recipe: str | Path | None, cli: dict[str, Any]) -> str:
    """One line per problem: the field, where its value came from, what is wrong (never the value)."""
    lines = []
    for problem in err.errors():
        rule = (problem.get("ctx") or {}).get("error")
        loc = rule.field.split(".") if isinstance(rule, RuleError) else [str(p) for p in problem["loc"]]
        message = str(rule) if isinstance(rule, RuleError) else problem["msg"]
        field = ".".join(loc)
        env_name = ENV_PREFIX + "__".join(loc).upper()
        if _has_path(cli, loc):
            source = "--set"
        elif env_name in {k.upper() for k in os.environ}:
            source = f"env {env_name}"
        else:
            source = str(recipe) if recipe is not None else "defaults"
        lines.append(f"{source}: {field}: {message}")
    return "invalid settings:\n  " + "\n  ".join(lines)


def _has_path(data: dict[str, Any], loc: list[str]) -> bool:
    node: Any = data
    for name in loc:
        if not isinstance(node, dict) or name not in node:
            return False
        node = node[name]
    return True


def to_env(settings: Settings) -> dict[str, str]:
    """Env vars (one JSON value per section) reproducing `settings` in a child process, secrets included."""

    def reveal(value: Any) -> Any:
        if isinstance(value, SecretStr):
            return value.get_secret_value()
        if isinstance(value, dict):
            return {k: reveal(v) for k, v in value.items()}
        return str(value) if isinstance(value, Path) else value

    return {
        f"{ENV_PREFIX}{name.upper()}": json.dumps(reveal(section.model_dump())) for name, section in settings
    }

"""Curators, engines and losses register by name in one place each; these tests fail when a registration
is forgotten: a class or module of the kind that its registry does not name, or a settings choice that
names nothing registered."""

import ast
import typing
from pathlib import Path

import pytest

from astraflow.dataflow import curators
from astraflow.dataflow.settings import FeederSettings
from astraflow.engines import engine_class
from astraflow.engines.base import Engine
from astraflow.engines.settings import ENGINE_TYPES, EngineSettings
from astraflow.trainer import losses
from astraflow.trainer.settings import LossSettings

ENGINES_DIR = Path(engine_class.__code__.co_filename).parent


def choices(model: type, field: str) -> tuple[str, ...]:
    return typing.get_args(model.model_fields[field].annotation)


def unregistered_curators(module) -> list[str]:
    """Concrete Curator classes of `module` that `CURATORS` does not hold."""
    return [
        name
        for name, value in vars(module).items()
        if isinstance(value, type)
        and issubclass(value, curators.Curator)
        and not getattr(value, "__abstractmethods__", ())
        and value not in curators.CURATORS.values()
    ]


def engine_modules(directory: Path) -> set[str]:
    """Modules of `directory` that name an engine class (`ENGINE = ...` at top level)."""
    out = set()
    for path in directory.glob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "ENGINE" for t in node.targets):
                out.add(path.stem)
    return out


def test_every_curator_is_registered_and_a_choice_of_the_settings():
    assert unregistered_curators(curators) == []
    assert choices(FeederSettings, "curator") == tuple(curators.CURATORS)
    assert {cls.name for cls in curators.CURATORS.values()} == set(curators.CURATORS)


def test_a_curator_without_its_registration_is_found():
    class Forgotten(curators.Curator):
        async def decide(self, rows, randoms, version):
            return []

    module = type(curators)("fake")
    module.Forgotten = Forgotten
    assert unregistered_curators(module) == ["Forgotten"]


def test_every_engine_module_is_a_choice_and_every_choice_an_engine():
    assert engine_modules(ENGINES_DIR) == set(ENGINE_TYPES)
    assert choices(EngineSettings, "type") == ("auto", *ENGINE_TYPES)
    assert issubclass(engine_class("openai"), Engine)
    with pytest.raises(ValueError, match="unknown engine type"):
        engine_class("base")


def test_an_engine_module_without_its_name_is_found(tmp_path):
    (tmp_path / "mine.py").write_text("class Mine:\n    pass\n\n\nENGINE = Mine\n")
    (tmp_path / "helper.py").write_text("X = 1\n")
    assert engine_modules(tmp_path) == {"mine"}


def test_every_loss_part_is_a_choice_of_the_settings():
    assert choices(LossSettings, "correction") == tuple(losses.CORRECTIONS)
    assert choices(LossSettings, "aggregation") == tuple(losses.AGGREGATIONS)
    assert choices(LossSettings, "kl_estimator") == tuple(losses.KL_ESTIMATORS)
    assert losses.WITHOUT_PROX <= set(losses.CORRECTIONS)
    assert not losses.needs_prox(LossSettings()) and losses.needs_prox(LossSettings(correction="tis"))

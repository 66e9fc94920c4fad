"""Experiment trackers as sinks of scalars: one ABC, an implementation per tracker, one factory.

A sink gets each policy's scalars at a step (its version) once; the tracker's package is imported only
when its sink is made, and a missing one is a one-line ConfigError naming what to install.
"""

from __future__ import annotations

import importlib
import importlib.util
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from astraflow.errors import ConfigError
from astraflow.tracking.settings import TrackingSettings


class Sink(ABC):
    @abstractmethod
    def log(self, policy: str, step: int, scalars: dict[str, float]) -> None:
        """Record `scalars` (names like `reward`, `eval/add/pass@1`) of `policy` at `step`."""

    @abstractmethod
    def flush(self) -> None:
        """Make what was logged durable (before the feed moves its cursor past it)."""

    @abstractmethod
    def close(self) -> None: ...


class TensorBoardSink(Sink):
    """Event files under `<dir>/tensorboard`; tags `<policy>/<name>` (`tensorboard --logdir` shows them)."""

    def __init__(self, root: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(root / "tensorboard"))

    def log(self, policy: str, step: int, scalars: dict[str, float]) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(f"{policy}/{name}", value, global_step=step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink(Sink):
    """A W&B run named after the astraflow run (offline files under `<dir>/wandb` unless `online`); each
    policy's metrics are plotted against its own `<policy>/version`."""

    def __init__(self, root: Path, run: str, settings: TrackingSettings) -> None:
        wandb: Any = importlib.import_module("wandb")
        mode = "online" if settings.online else "offline"
        self.run = wandb.init(project=settings.project, name=run, dir=str(root), mode=mode)
        self.policies: set[str] = set()

    def log(self, policy: str, step: int, scalars: dict[str, float]) -> None:
        if policy not in self.policies:  # versions of two policies need not rise together
            self.run.define_metric(f"{policy}/*", step_metric=f"{policy}/version")
            self.policies.add(policy)
        self.run.log({f"{policy}/version": step, **{f"{policy}/{k}": v for k, v in scalars.items()}})

    def flush(self) -> None:
        """Nothing to do: `log` hands each row to the W&B writer process, which writes it."""

    def close(self) -> None:
        self.run.finish()


class MlflowSink(Sink):
    """An MLflow run named after the astraflow run (a file store under `<dir>/mlruns` unless `online`)."""

    def __init__(self, root: Path, run: str, settings: TrackingSettings) -> None:
        mlflow: Any = importlib.import_module("mlflow")
        self.mlflow = mlflow
        if not settings.online:
            mlflow.set_tracking_uri((root / "mlruns").resolve().as_uri())
        mlflow.set_experiment(settings.project)
        self.active = mlflow.start_run(run_name=run)

    def log(self, policy: str, step: int, scalars: dict[str, float]) -> None:
        self.mlflow.log_metrics({f"{policy}/{k}": v for k, v in scalars.items()}, step=step)

    def flush(self) -> None:
        """Nothing to do: `log_metrics` returns once the store holds them."""

    def close(self) -> None:
        self.mlflow.end_run()


REQUIRES = {
    "tensorboard": ("tensorboard", "tracking"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
}
"""Sink type -> (the package it imports, the astraflow extra that installs it)."""


def check_installed(settings: TrackingSettings) -> None:
    """A ConfigError naming the missing package of the first configured sink that has none."""
    for t in settings.sinks:
        package, extra = REQUIRES[t]
        if importlib.util.find_spec(package) is None:
            raise ConfigError(f"tracking.sinks: {t} needs {package}: pip install 'astraflow[{extra}]'")


def make_sinks(settings: TrackingSettings, root: Path, run: str) -> list[Sink]:
    """A sink per `tracking.sinks` entry, writing under `root`."""
    check_installed(settings)
    sinks: list[Sink] = []
    for t in settings.sinks:
        if t == "tensorboard":
            sinks.append(TensorBoardSink(root))
        elif t == "wandb":
            sinks.append(WandbSink(root, run, settings))
        elif t == "mlflow":
            sinks.append(MlflowSink(root, run, settings))
        else:
            raise ValueError(f"unknown tracking sink type: {t!r}")
    return sinks

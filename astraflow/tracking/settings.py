"""Settings of the experiment trackers the run's metrics stream is fed to."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

SinkType = Literal["tensorboard", "wandb", "mlflow"]


class TrackingSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    sinks: list[SinkType] = Field(default_factory=list)
    """Trackers fed from the run's `metrics` stream: every trainer step (its statistics and the reward of
    the rollouts collected for it) and every eval result, once each, keyed by version. `tensorboard`
    needs the `tracking` extra (`pip install 'astraflow[tracking]'`); `wandb` and `mlflow` need those
    packages. `astraflow run` feeds them; for separately started workers, `astraflow track`."""
    dir: Path | None = None
    """Where the trackers write (TensorBoard event files, W&B and MLflow offline files) and the feed
    keeps its cursor; default `<run dir>/tracking`."""
    project: str = "astraflow"
    """The W&B project / MLflow experiment; the run's name names the tracker's run."""
    online: bool = False
    """W&B / MLflow: send to the configured server (`WANDB_API_KEY`, `MLFLOW_TRACKING_URI`); off: offline
    files under `dir` (`wandb sync`, `mlflow ui --backend-store-uri` read them)."""
    poll_s: float = Field(2.0, gt=0)
    """How often the feed reads new entries."""

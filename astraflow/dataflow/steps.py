"""What the dataflow's atomic steps (`dataflow.store`) take and return."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SubmitItem:
    """One dataset position: submitted as `fields` (a PromptGroup entry) or skipped by the curator."""

    submit: bool
    uid: str
    row: int
    version: int
    fields: Mapping[str, bytes]


@dataclass(frozen=True)
class Room:
    """What the back-pressure limits admit now (a hint: `Store.submit` checks again, atomically)."""

    groups: int
    """Prompt groups that may be submitted."""
    ready_full: bool
    """No room because the ready sets are full (then a settle frees nothing: only a batch formed does)."""
    cursor: int
    notice: int | None
    """The state's dataset cursor and last version announced (None: none yet)."""
    eval_due: int | None = None
    """The last notice when it is of an eval version whose groups no one submitted (its barrier's replica
    died first): the feeder submits them."""


@dataclass(frozen=True)
class Part:
    """One model's share of a collected group: accepted (reason '') or dropped with a reason."""

    model: str
    reason: str
    min_version: int
    n_samples: int
    payload: bytes = b""


@dataclass(frozen=True)
class EvalRow:
    """One collected eval row: per policy its metrics, or why it was dropped (`reason`)."""

    version: int
    dataset: str
    scores: Mapping[str, Mapping[str, float]]
    reason: str = ""


@dataclass(frozen=True)
class Collected:
    """A decoded rollout entry and what the collector decided for it."""

    entry_id: str
    uid: str
    parts: Sequence[Part]
    rewards: Mapping[str, tuple[float, int]]
    """Per model, in the group's order: (mean reward, trajectories) of the trajectories that did not fail."""
    zero_variance: bool
    trace: Mapping[str, str]
    metrics: Mapping[str, Mapping[str, tuple[float, int]]] = field(default_factory=dict)
    """Per model and workflow metric: (sum, trajectories reporting it) over the trajectories that did not
    fail."""

    eval: EvalRow | None = None
    """An eval group's scores (it has no parts: nothing of it is ever trained on)."""

    @property
    def mean_reward(self) -> float | None:
        """The first model's mean reward (what the curators follow)."""
        return next((mean for mean, _ in self.rewards.values()), None)


@dataclass(frozen=True)
class Settled:
    """What a settle (`Store.collect`) did."""

    records_written: bool
    """The `metrics` entries went out with it (every item settled 'ok')."""
    replies: list[list[str]]
    """Per item: [status, outcome per part...] (collect.lua)."""
    room: Room | None = None
    """The feeder's room just after the settle, under the limits asked for (None: none asked)."""

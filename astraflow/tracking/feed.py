"""The run's `metrics` stream as tracker records: each trainer step and each eval result once, by version.

`Feed.consume` turns entries (read in stream order) into `(policy, step, scalars)` records, as the
launcher's progress view reads them: a step's `reward` is the mean reward of the rollouts collected since
that policy's previous step (`kind=rollouts`, before any filter), else the batch's; an eval result is
the mean of its metrics over its rows (`kind=eval` entries added up), logged once every row of its
dataset was scored (`kind=eval_submitted` says how many), or at the end of the run with those scored.
The whole state is plain data (`as_dict`/`from_dict`): saved with the cursor, a restarted feed neither
repeats nor loses a step, and a version a restarted trainer trains again is not logged twice.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from astraflow.streams.records import (
    EvalResult,
    EvalSubmitted,
    RolloutStats,
    TrainerStep,
    add_metrics,
    decode_record,
)

Record = tuple[str, int, dict[str, float]]
"""(policy, step: its version, scalars)."""
DONE_KEPT = 1000
"""Eval results remembered as logged (the newest), so late rows of one are not logged again."""


@dataclass
class Feed:
    models: list[str]
    """The trained policies (a step is one of theirs)."""
    run: str = ""
    """The nonce of the run the state belongs to (a new run of the same name starts over)."""
    cursor: str = "0-0"
    """The id of the last entry consumed."""
    logged: dict[str, int] = field(default_factory=dict)
    """Per policy, the newest version logged."""
    pending: dict[str, list[float]] = field(default_factory=dict)
    """Per policy, [reward sum, samples] of rollouts collected since its last step."""
    pending_metrics: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    """Per policy, per workflow metric, [sum, trajectories] since its last step."""
    evals: dict[str, list] = field(default_factory=dict)
    """`["model", "dataset", version]` (as JSON) -> [rows, {metric: sum}] of an eval result not logged yet."""
    sizes: dict[str, int] = field(default_factory=dict)
    """`dataset|version` -> rows its eval has."""
    done: list[str] = field(default_factory=list)
    """Eval results logged (keys as in `evals`)."""

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Feed:
        return cls(**data)

    def consume(self, entries: Iterable[tuple[str, dict[str, str]]]) -> list[Record]:
        """Records of `(entry id, fields)` entries after the cursor, in stream order."""
        out: list[Record] = []
        for entry_id, f in entries:
            self.cursor = entry_id
            r = decode_record(f)
            if isinstance(r, EvalSubmitted):
                self.sizes[f"{r.dataset}|{r.version}"] = r.rows
            elif isinstance(r, EvalResult):
                self._eval(r, out)
            elif not isinstance(r, RolloutStats | TrainerStep) or r.model not in self.models:
                continue
            elif isinstance(r, RolloutStats):
                acc = self.pending.setdefault(r.model, [0.0, 0])
                acc[0], acc[1] = acc[0] + r.reward_sum, acc[1] + r.samples
                add_metrics(self.pending_metrics.setdefault(r.model, {}), r.metrics)
            else:
                self._step(r, out)
        return out

    def _step(self, r: TrainerStep, out: list[Record]) -> None:
        model, stats, version = r.model, r.stats, r.version
        reward_sum, samples = self.pending.pop(model, [0.0, 0])
        metrics = self.pending_metrics.pop(model, {})
        if version <= self.logged.get(model, -1):  # trained again after a trainer restart: logged once
            return
        scalars = {k: float(v) for k, v in stats.items() if isinstance(v, int | float)}
        scalars["reward"] = reward_sum / samples if samples else float(stats.get("reward_mean", 0.0))
        scalars.update({f"rollout_{name}": total / n for name, (total, n) in metrics.items() if n})
        self.logged[model] = version
        out.append((model, version, scalars))

    def _eval(self, r: EvalResult, out: list[Record]) -> None:
        key = json.dumps([r.model, r.dataset, r.version])
        if key in self.done:
            return
        rows, sums = self.evals.setdefault(key, [0, {}])
        for name, total in r.sums.items():
            sums[name] = sums.get(name, 0.0) + total
        self.evals[key][0] = rows = rows + r.rows
        size = self.sizes.get(f"{r.dataset}|{r.version}")
        if size is not None and rows >= size:
            out.append(self._logged(key))

    def finish(self) -> list[Record]:
        """The eval results not complete yet, with the rows scored (the run has stopped)."""
        return [self._logged(key) for key in list(self.evals)]

    def _logged(self, key: str) -> Record:
        rows, sums = self.evals.pop(key)
        self.done = [*self.done, key][-DONE_KEPT:]
        model, dataset, version = json.loads(key)
        return model, version, {f"eval/{dataset}/{name}": total / rows for name, total in sums.items()}

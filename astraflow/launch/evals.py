"""Eval results as the launcher and `astraflow top` see them: the metrics stream's `kind=eval` entries
(written by the dataflow's collector as it scores eval rows), added up per policy, dataset and version."""

from __future__ import annotations

from dataclasses import dataclass, field

from astraflow.streams import records


@dataclass
class EvalResult:
    model: str
    dataset: str
    version: int
    """The weight version every row was sampled at."""
    rows: int = 0
    """Rows scored."""
    sums: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0
    """When the last of its rows was scored (seconds since the run started)."""

    def values(self) -> dict[str, float]:
        return {name: total / self.rows for name, total in self.sums.items()}

    def as_dict(self) -> dict:
        keys = {"model": self.model, "dataset": self.dataset, "version": self.version, "rows": self.rows}
        return {**keys, "wall_s": round(self.wall_s, 3), **self.values()}


class EvalResults:
    def __init__(self) -> None:
        self.results: dict[tuple[str, str, int], EvalResult] = {}
        self.sizes: dict[tuple[str, int], int] = {}
        """(dataset, version) -> rows its eval has (`kind=eval_submitted`): fewer scored, the run stopped
        mid-eval (or some were dropped: the ledger's `eval_dropped`)."""

    def __bool__(self) -> bool:
        return bool(self.results)

    def add(self, record: records.EvalResult | records.EvalSubmitted, wall_s: float) -> None:
        """Add one eval record (rows of one policy, dataset and version scored together), or one eval
        submitted (how many rows a dataset's eval at a version has)."""
        if isinstance(record, records.EvalSubmitted):
            self.sizes[(record.dataset, record.version)] = record.rows
            return
        key = (record.model, record.dataset, record.version)
        result = self.results.setdefault(key, EvalResult(*key))
        result.rows += record.rows
        for name, total in record.sums.items():
            result.sums[name] = result.sums.get(name, 0.0) + total
        result.wall_s = wall_s

    def as_list(self) -> list[dict]:
        """Every result, by version, for `summary.json` (`of`: the rows its eval has; None: not known)."""
        ordered = sorted(self.results.items(), key=lambda kv: (kv[0][2], kv[0][:2]))
        return [{**r.as_dict(), "of": self.sizes.get((r.dataset, r.version))} for _, r in ordered]

    def curves(self) -> dict[tuple[str, str, str], list[tuple[int, float, float]]]:
        """(model, dataset, first metric) -> (version, wall seconds, value) by version: the plot's points."""
        out: dict[tuple[str, str, str], list[tuple[int, float, float]]] = {}
        for (model, dataset, version), r in sorted(self.results.items(), key=lambda kv: kv[0][2]):
            values = r.values()
            if values:
                metric, value = next(iter(values.items()))
                out.setdefault((model, dataset, metric), []).append((version, r.wall_s, value))
        return out

    def latest(self) -> dict[str, str]:
        """Per policy, its newest result on the first dataset: `v4 add pass@1 0.750` (the live view)."""
        out = {}
        for (model, dataset, metric), points in self.curves().items():
            if model not in out:
                version, _, value = points[-1]
                rows, of = self.results[(model, dataset, version)].rows, self.sizes.get((dataset, version))
                partial = f" ({rows}/{of} rows)" if of is not None and rows < of else ""
                out[model] = f"v{version} {dataset} {metric} {value:.3f}{partial}"
        return out

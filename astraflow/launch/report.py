"""What a run leaves: `summary.json` and `reward.png` (reward, the workflow's metrics such as the tool-call
rate, and each policy's eval results against step and time)."""

from __future__ import annotations

import json
from pathlib import Path

from astraflow.launch.progress import Progress, moving, samples_per_s


def summary(progress: Progress, window: int, extra: dict) -> dict:
    """Per model also `trained_share`: of the groups collected (generated and scored), the share trained,
    i.e. of the generated samples, the share that was trained (when `extra` holds the run's ledger)."""
    models = {}
    ledger = extra.get("ledger", {}).get("models", {})
    for name, m in progress.models.items():
        rewards = [r for _, _, r in m.steps]
        models[name] = {
            "versions": m.steps[-1][0] if m.steps else 0,
            "reward_first_window": sum(rewards[:window]) / len(rewards[:window]) if rewards else None,
            "reward_last_window": m.moving_reward(window),
            "samples": m.samples,
            "samples_per_s": samples_per_s(m),
            "train_s": round(m.train_s, 3),
            "first_step_s": m.steps[0][1] if m.steps else None,
            "last_step_s": m.steps[-1][1] if m.steps else None,
        }
        if name in ledger:
            models[name]["trained_share"] = ledger[name]["trained"] / max(ledger[name]["collected"], 1)
        for metric, points in m.curves.items():  # e.g. tool_call_first_window, tool_call_last_window
            models[name][f"{metric}_first_window"] = moving(points[:window], window)
            models[name][f"{metric}_last_window"] = moving(points, window)
    timing = {"generating_s": round(progress.generating_s, 3)}
    data = {"models": models, "evals": progress.evals.as_list(), **timing, **extra}
    if "redis_commands" in extra:  # the run's coordination cost per sample it trained
        trained = sum(m["samples"] for m in models.values())
        data["redis_commands_per_sample"] = round(extra["redis_commands"] / max(trained, 1), 2)
    return data


def busy_line(data: dict) -> str:
    """One line: the run's wall time and steps, and the share of it each stage was busy - generating
    (a RaaS had a group in flight) and training (forward, backward, optimizer) - each process's CPU, and
    the share of the generated samples that was trained, and the Redis commands (those its scripts ran
    included) per trained sample, when counted."""
    wall = data["wall_s"] or 1e-9
    steps = ", ".join(f"{name} {m['versions']} steps" for name, m in data["models"].items())
    train = sum(m["train_s"] for m in data["models"].values())
    cpu = ", ".join(f"{name} {c / wall:.0%}" for name, c in data.get("cpu_s", {}).items())
    shares = {name: m["trained_share"] for name, m in data["models"].items() if "trained_share" in m}
    trained = ", ".join(
        f"{'' if len(shares) == 1 else name + ' '}{share:.0%}" for name, share in shares.items()
    )
    per_sample = data.get("redis_commands_per_sample")
    redis = f"; redis {per_sample:.1f} commands/sample" if per_sample is not None else ""
    return (
        f"{data['wall_s']:.1f}s, {steps}; busy: generating {data['generating_s'] / wall:.0%},"
        f" training {train / wall:.0%}; cpu: {cpu}{redis}"
        + (f"; trained of generated: {trained}" if shares else "")
    )


def write(run_dir: Path, progress: Progress, window: int, extra: dict) -> dict:
    data = summary(progress, window, extra)
    (run_dir / "summary.json").write_text(json.dumps(data, indent=2))
    plot(run_dir / "reward.png", progress, window)
    return data


def plot(path: Path, progress: Progress, window: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    for name, m in progress.models.items():
        curves = [("reward", m.steps, "-"), *((f"{k} rate", v, "--") for k, v in m.curves.items())]
        for what, points, style in curves:
            ma = [moving(points[: i + 1], window) for i in range(len(points))]
            label = f"{name} {what} (ma{window})"
            by_step.plot([s for s, _, _ in points], ma, style, label=label)
            by_time.plot([t for _, t, _ in points], ma, style, label=label)
    for (name, dataset, metric), points in progress.evals.curves().items():  # every policy's
        label = f"{name} eval {dataset} {metric}"
        by_step.plot([v for v, _, _ in points], [x for _, _, x in points], "o-", label=label)
        by_time.plot([t for _, t, _ in points], [x for _, _, x in points], "o-", label=label)
    by_step.set_xlabel("trainer step (version)")
    by_time.set_xlabel("wall time (s)")
    for ax in (by_step, by_time):
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

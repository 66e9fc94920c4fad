"""Every bench script at its `--smoke` size: it completes and prints its figure line.

The figures are never checked (a smoke size measures nothing): what a user would notice is a bench that
hangs, crashes or no longer prints its result. A script added to tests/bench without an entry in FIGURES
fails `test_every_bench_script_has_a_smoke_entry`.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parent
ROOT = BENCH.parents[1]
NUMBER = r"(?:[0-9.]+|nan|inf)"

FIGURES = {
    "agent_client": rf"^agent client: per-episode/shared tls cpu per episode {NUMBER}x at \d+ in flight$",
    "bus_throughput": rf"^consume \+ publish_and_ack +\d+ +\d+ +{NUMBER}$",
    "cross_region": rf"^v1 delta +relay +{NUMBER} +{NUMBER} +{NUMBER}x +{NUMBER}x$",
    "dataflow_throughput": rf"^1 +\d+ +\d+ +\d+ +{NUMBER}$",
    "dataflow_cpu": rf"^dataflow cpu: group {NUMBER} us, round trip {NUMBER} us \(encoded in {NUMBER} us\)$",
    "e2e": r"^e2e: astraflow/TRL \S+, astraflow/plain \S+, astraflow/plain\+ds \S+, sync/plain\+ds \S+ "
    r"\(\d+ seeds\)$",
    "eval_overhead": rf"^eval overhead: recipe {NUMBER}, every 1 versions {NUMBER} \(\d+ seeds\)$",
    "hf_generate": rf"^ +top-k 50, top-p 0.9 \| +{NUMBER} +{NUMBER} +{NUMBER}x$",
    "logprob_memory": rf"^ float32 +{NUMBER} \|.*\| .* {NUMBER}x \| +{NUMBER} +{NUMBER}$",
    "lora_rise": r"^lora rise: hf [-+][0-9.]+, vllm -, full - in \d+ s \(\d+ rounds\)$",
    "plain_loop": rf"^plain loop: \d+ steps, time to {NUMBER}: .*; per step generate {NUMBER} ms, train ",
    "publication_state": rf"^publication \(.*\): trainer blocked {NUMBER}x shorter, {NUMBER}x fewer bytes",
    "raas_generation": rf"^raas generation: pipeline/generate {NUMBER} per thread$",
    "raas_scaling": rf"^ +1 +{NUMBER} +{NUMBER} +{NUMBER} +{NUMBER}$",
    "raas_throughput": rf"^hf +\d+ +\d+ +{NUMBER}$",
    "real_shape_run": r"^real-shape run tiny: \d+ versions trained \(run.max_steps 2\), completed, no OOM",
    "replica_ack": rf"^1 +\d+ +{NUMBER}$",
    "settle_bytes": rf"^settle bytes: passed/multi redis cpu {NUMBER}, client cpu {NUMBER} at \d+ KiB",
    "step_memory": rf"^step peak above the model: whole logits {NUMBER} GiB, chunked {NUMBER} GiB .*s$",
    "staleness": rf"^staleness: fastest to {NUMBER}: .+ \(\d+ cells\)$",
    "tool_sandbox": rf"^process group +{NUMBER} +{NUMBER}$",
    "trace_growth": rf"^trace growth: shipped \d+ keys {NUMBER} MiB, before -, none \d+ keys {NUMBER} MiB "
    r"\(\d+ s\)$",
    "trainer_step": rf"^ +1 +{NUMBER} +{NUMBER} +{NUMBER}$",
    "trl_loop": rf"^trl GRPOTrainer: \d+ steps, time to {NUMBER}: .*; {NUMBER} ms per step \(\d+ threads\)$",
    "vllm_client": rf"^vllm client: httpx/aiohttp cpu per call {NUMBER}x, httpx default/aiohttp {NUMBER}x "
    r"at \d+ in flight$",
    "vllm_groups": rf"^vllm groups: merged/per-sample samples/s {NUMBER}x, cpu per sample {NUMBER}x less$",
    "vllm_queue_nap": rf"^vllm queue nap: nap/spin samples/s {NUMBER}x, neighbour's work {NUMBER}x$",
    "vllm_lora_ops": rf"^ +\d+ +\d+ \| +{NUMBER} +{NUMBER} +{NUMBER}x$",
    "warm_start_threads": rf"^warm start threads: picked/one time alone {NUMBER}x, beside a busy neighbour "
    rf"{NUMBER}x$",
    "weight_path": rf"^weight path tiny: {NUMBER} GiB served, trainer blocked {NUMBER}m, .* smaller$",
    "weight_sync": rf"^\(d\) .*: star {NUMBER} s, chain {NUMBER} s, ratio {NUMBER}$",
}
"""Script -> a regular expression (per line) of its figure line at the smoke size, in the format its full
size prints."""

ALSO = {"e2e": r"^from weights [0-9a-f]{12} \(torch \S+, transformers \S+\)$"}
"""Script -> another line it must print: e2e's figures hold only for the weights it names."""

SLOW = {
    "e2e",
    "eval_overhead",
    "lora_rise",
    "raas_generation",
    "raas_throughput",
    "real_shape_run",
    "staleness",
    "trace_growth",
    "trl_loop",
    "vllm_groups",
    "vllm_queue_nap",
}
"""Whole runs or several worker processes, each importing torch: 30 s or more on two busy cores."""


def scripts() -> list[str]:
    """The bench scripts: every module of tests/bench but this test and helpers (`_*.py`)."""
    return sorted(p.stem for p in BENCH.glob("*.py") if p.name != Path(__file__).name and p.name[0] != "_")


def test_every_bench_script_has_a_smoke_entry():
    assert set(scripts()) == set(FIGURES), "add the new script's figure line to FIGURES (and `--smoke`)"


@pytest.mark.bench
@pytest.mark.parametrize(
    "script",
    [
        pytest.param(s, marks=[pytest.mark.slow, pytest.mark.timeout(420)] if s in SLOW else [])
        for s in scripts()
    ],
)
def test_bench_completes_at_its_smoke_size_and_prints_its_figures(script, tmp_path):
    out, err, code = run(BENCH / f"{script}.py", tmp_path, timeout_s=360 if script in SLOW else 80)
    assert code == 0, f"exit {code}\n{out[-3000:]}\n{err[-3000:]}"
    assert re.search(FIGURES[script], out, re.MULTILINE), f"no figure line in:\n{out[-3000:]}"
    if script in ALSO:
        assert re.search(ALSO[script], out, re.MULTILINE), f"no {ALSO[script]!r} line in:\n{out[-3000:]}"


def run(script: Path, tmp: Path, timeout_s: float) -> tuple[str, str, int]:
    """`python SCRIPT --smoke` from the repository root, its temporary files under `tmp`. Past `timeout_s`
    it gets SIGINT (its `finally` blocks stop the servers it started), 30 s later SIGKILL (within the
    test's timeout: 120 s, 420 for SLOW)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "TMPDIR": str(tmp)}
    proc = subprocess.Popen(
        [sys.executable, str(script), "--smoke"],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        pytest.fail(
            f"{script.name} --smoke still running after {timeout_s:.0f} s\n{out[-3000:]}\n{err[-3000:]}"
        )
    return out, err, proc.returncode

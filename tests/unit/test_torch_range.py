"""The supported torch range: one declaration (`torch_range`), which pyproject's minimum, CI's oldest torch
and the pinned stack agree with, and the GPU check's refusal."""

import re
from pathlib import Path

import pytest

from astraflow.trainer import torch_range

ROOT = Path(__file__).resolve().parents[2]


def test_pyproject_and_ci_declare_the_range_the_code_does():
    text = (ROOT / "pyproject.toml").read_text()
    minimums = set(re.findall(r'"torch>=([\d.]+)"', text))
    assert minimums == {"{}.{}".format(*torch_range.OLDEST)}, minimums
    assert "torch==" not in text  # a minimum, not a pin
    oldest = re.search(r"^OLDEST_TORCH := ([\d.]+)$", (ROOT / "Makefile").read_text(), re.M)
    assert oldest and torch_range.parse(oldest[1]) == torch_range.OLDEST  # CI tests the floor itself
    assert "make test-oldest-torch" in (ROOT / ".ci/run").read_text()


def test_the_pinned_stack_is_in_range():
    torch = pytest.importorskip("torch")
    assert torch_range.refusal(torch.__version__) is None


@pytest.mark.parametrize("version", ["2.6.0+cu124", "2.14.0", "3.0.0"])
def test_a_torch_outside_the_range_is_refused_in_one_line_naming_it(version):
    why = torch_range.refusal(version)
    assert why is not None and "\n" not in why and "torch 2.7 to 2.13.x" in why and version in why


@pytest.mark.parametrize("version", ["2.7.1+cu126", "2.11.0+cu130", "2.13.0"])
def test_the_ends_and_the_gpu_nodes_torch_are_supported(version):
    assert torch_range.refusal(version) is None


def test_lora_under_fsdp2_is_refused_below_the_torch_it_was_shown_on():
    assert "LoRA under FSDP2 needs torch 2.13" in torch_range.lora_sharding_refusal("2.7.1+cu126")
    assert torch_range.lora_sharding_refusal("2.13.0+cpu") is None

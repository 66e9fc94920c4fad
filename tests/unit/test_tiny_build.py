"""The recipe's tiny model is built once however many processes start at once (a trainer and a RaaS
started together): the others wait for that build instead of deleting it under its builder, and every
one of them gets the finished model. The warm start says how far it got while it runs."""

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

BUILD = textwrap.dedent(
    """
    import sys
    from transformers import AutoModelForCausalLM
    from astraflow.settings_load import load_settings
    from astraflow.launch.tiny_cache import build_tiny
    tiny = "{hidden: 32, layers: 1, heads: 2, kv_heads: 1, intermediate: 64, warm_start_steps: 40}"
    path = build_tiny(load_settings(overrides=["run.tiny=" + tiny, "trainer.threads=1"]))
    AutoModelForCausalLM.from_pretrained(path)
    print("loaded", path)
    """
)


def test_two_processes_building_at_once_both_get_the_model_built_once(tmp_path):
    out = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    procs = [subprocess.Popen([sys.executable, "-c", BUILD], cwd=tmp_path, **out) for _ in range(2)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert all("loaded" in out for out in outs), outs
    assert sum(out.count("building the tiny model") for out in outs) == 1, outs


def test_the_warm_start_prints_progress_lines(capsys):
    from astraflow.launch.tiny_cache import warm_start_progress

    on_step = warm_start_progress(300, every_s=0.0)
    for done in (1, 120, 300):
        on_step(done, 0.5)
    out = capsys.readouterr().out.splitlines()
    assert out == ["warm start: 1/300 steps (0%), loss 0.500", "warm start: 120/300 steps (40%), loss 0.500"]

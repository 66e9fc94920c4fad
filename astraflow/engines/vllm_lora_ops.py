"""vLLM-CPU's LoRA ops, one matrix product per adapter in the batch.

vLLM's CPU backend applies adapters with the torch ops of `vllm.lora.ops.torch_ops`: each op gathers a
copy of the adapter's matrix for every token (`weights[indices]`) and multiplies token by token
(`einsum("bi, boi -> bo")`): 4.6-9.7 times the time of the products below for one forward pass at the
LoRA recipe's shape, 37 times at Qwen2.5-0.5B's (`tests/bench/vllm_lora_ops.py`, one adapter), and 40% of
the vLLM worker's CPU in a LoRA run. `install` puts the functions below in their place: the same
signatures and the same results (each token's rows times its adapter's matrix, an index of -1 picking the
last slot as indexing does), a product per distinct adapter instead of a gather per token. The `sgmv_*`
ops call these too, through the module's globals. `vllm_plugin.register` installs them in every vLLM
process on the CPU platform.
"""

from __future__ import annotations

import torch


def product(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, dtype) -> torch.Tensor:
    """`einsum("bi, boi -> bo", inputs, weights[indices])` in `dtype`: row b of `inputs` times the matrix
    `weights[indices[b]]` (`weights` [slots, out, in], or [slots, 1, out, in] as vLLM stacks them)."""
    w = weights.squeeze(1) if weights.dim() == 4 else weights
    x = inputs.to(dtype)
    if indices.numel() == 0:
        return x.new_zeros(0, w.shape[1])
    first = int(indices[0])
    if indices.numel() == 1 or bool((indices == first).all()):
        return x @ w[first].to(dtype).T
    out = x.new_empty(x.shape[0], w.shape[1])
    for i in indices.unique().tolist():
        rows = indices == i
        out[rows] = x[rows] @ w[i].to(dtype).T
    return out


def bgmv_shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling: float = 1.0):
    outputs = product(inputs, lora_a_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs


def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs: bool = True):
    outputs = product(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    limit = output_tensor.shape[0]
    if outputs.shape[0] == 1 and output_tensor.shape[0] != 1:
        limit = 1
    # The adapter and the model may pad their outputs differently.
    common = min(outputs.shape[1], output_tensor.shape[1])
    if add_inputs:
        output_tensor[:, :common] += outputs[:limit, :common]
    else:
        output_tensor[:, :common] = outputs[:limit, :common]


def bgmv_expand_slice(
    inputs,
    lora_b_weights,
    output_tensor,
    lora_indices_tensor,
    slice_offset: int,
    slice_size: int,
    add_inputs: bool = True,
):
    outputs = product(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset : slice_offset + slice_size] += outputs
    else:
        output_tensor[:, slice_offset : slice_offset + slice_size] = outputs


OPS = {"bgmv_shrink": bgmv_shrink, "bgmv_expand": bgmv_expand, "bgmv_expand_slice": bgmv_expand_slice}


def install() -> None:
    """Put `OPS` in place of vLLM's torch LoRA ops: in their module (which its `sgmv_*` ops call) and in
    the CPU punica wrapper, which imported them by name."""
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    for module in (lora_ops, punica_cpu):
        for name, op in OPS.items():
            setattr(module, name, op)

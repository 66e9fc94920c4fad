"""Logprobs of the trainer computed a chunk of positions at a time: the values and gradients of the plain
`log_softmax(logits.float()).gather(targets)`, without a float32 tensor over the whole micro-batch."""

from __future__ import annotations

import pytest

from astraflow.trainer.batching import (
    LOGPROB_CHUNK_ROWS,
    Sample,
    collate,
    micro_batches,
    samples,
    target_logprobs,
    token_logprobs,
)
from tests.trainer_helpers import make_batch

torch = pytest.importorskip("torch")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def reference(logits, targets):
    """Today's textbook path: the whole vocabulary in float32 for every position."""
    logp_all = torch.log_softmax(logits.float(), -1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return logp, -(logp_all.exp() * logp_all).sum(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_logprobs_equal_log_softmax_in_value_and_gradient(dtype):
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 7, 50, generator=g)).to(dtype).requires_grad_()
    targets = torch.randint(0, 50, (3, 7), generator=g)
    weights = torch.randn(3, 7, generator=g)  # an advantage-like upstream gradient
    grads = []
    for chunked in (True, False):
        logits.grad = None
        if chunked:  # 21 positions in chunks of 4: a short last chunk
            logp, entropy = target_logprobs(logits, targets, with_entropy=True, chunk_rows=4)
        else:
            logp, entropy = reference(logits, targets)
        (logp * weights).sum().backward()
        grads.append((logp.detach(), entropy.detach(), logits.grad.clone()))
    (logp, entropy, grad), (ref_logp, ref_entropy, ref_grad) = grads
    assert logp.dtype == torch.float32 and grad.dtype == dtype
    assert torch.allclose(logp, ref_logp, atol=1e-5)
    assert torch.allclose(entropy, ref_entropy, atol=1e-5)
    assert torch.allclose(grad.float(), ref_grad.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_models_gradient_is_that_of_the_plain_path(tiny_model, dtype):
    """The trainer's whole path on a tiny model (bf16: under autocast, as `trainer.dtype: bfloat16`):
    logprobs, entropies and the parameters' gradients equal those of the full log-softmax."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    seqs = [[5, 6, 7, 8, 9, 10, 11], [5, 6, 10], [5, 6, 13, 14, 15]]
    batch = make_batch(model, seqs, [1, 0, 0.5])
    [mb] = micro_batches(samples(batch), 10_000)
    results = []
    for chunked in (True, False):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            if chunked:
                logp, entropy = token_logprobs(model, mb, with_entropy=True, chunk_rows=5)
            else:
                logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
                assert logits.dtype == dtype
                logp, entropy = reference(logits[:, :-1], mb.targets)
        ((logp * mb.adv) * mb.mask).sum().backward()
        grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results.append((logp.detach(), entropy, grad))
    (logp, entropy, grad), (ref_logp, ref_entropy, ref_grad) = results
    assert logp.shape == mb.targets.shape and entropy.shape == mb.targets.shape
    assert torch.allclose(logp, ref_logp, atol=1e-5) and torch.allclose(entropy, ref_entropy, atol=1e-5)
    assert not entropy.requires_grad
    scale = float(ref_grad.abs().max())
    assert torch.allclose(grad, ref_grad, atol=TOL[dtype] * scale, rtol=TOL[dtype])


class Record:
    """Tensors created with memory of their own (views excluded) and tensors saved for the backward."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        created: list[torch.Tensor] = []
        self.created, self.saved = created, []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                inputs = torch.utils._pytree.tree_leaves((args, kwargs))
                shared = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
                out = func(*args, **(kwargs or {}))
                for t in torch.utils._pytree.tree_leaves(out):
                    if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in shared:
                        created.append(t)
                return out

        self.mode = Mode()

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(
            lambda t: self.saved.append(t) or t, lambda t: t
        )
        self.hooks.__enter__()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        self.hooks.__exit__(*exc)


def test_no_float32_tensor_spans_more_positions_than_a_chunk():
    """bf16 logits over more positions than one chunk: the forward and backward of the logprobs (with
    entropy) create no float32 tensor larger than a chunk x the vocabulary, keep none for the backward,
    and the only tensor as large as the logits is their gradient, in their dtype."""
    vocab, rows = 64, 2 * LOGPROB_CHUNK_ROWS + 100
    bound = LOGPROB_CHUNK_ROWS * vocab
    logits = torch.randn(2, rows // 2, vocab).to(torch.bfloat16).requires_grad_()
    mb = _micro_batch(rows // 2)
    targets = torch.nn.functional.pad(mb.targets, (0, 1))
    with Record() as r:
        logp, entropy = target_logprobs(logits, targets, with_entropy=True)
        ((logp[:, :-1] * mb.adv) * mb.mask).sum().backward()
    assert logp.shape == (2, rows // 2) and entropy is not None

    big_fp32 = [tuple(t.shape) for t in r.created + r.saved if t.dtype == torch.float32 and t.numel() > bound]
    assert big_fp32 == []
    big = [t for t in r.created if t.numel() > bound]
    assert [(t.dtype, t.numel()) for t in big] == [(torch.bfloat16, logits.numel())]  # the gradient
    assert torch.equal(logits.grad.flatten(), big[0].flatten())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_models_logprobs_never_hold_the_whole_micro_batchs_logits(tiny_model, monkeypatch, dtype):
    """Through a real model: the logprobs, entropies and every gradient equal those of the model's full
    logits, while no tensor as large as a micro-batch's logits ever exists (forward or backward): the
    lm_head computes a few positions at a time and recomputes them in the backward."""
    from transformers import AutoModelForCausalLM

    from astraflow.trainer import devices, head

    monkeypatch.setattr(head, "HEAD_CHUNK_ROWS", 16)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    vocab = model.config.vocab_size
    mb = _micro_batch(40)  # 80 positions: 5 chunks
    grads = []
    for path in ("full", "chunked"):
        model.zero_grad(set_to_none=True)
        with devices.autocast(torch.device("cpu"), dtype), Record() as r:
            if path == "full":
                logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits[:, :-1]
                logp, entropy = target_logprobs(logits, mb.targets, with_entropy=True)
            else:
                logp, entropy = token_logprobs(model, mb, with_entropy=True)
        ((logp * mb.adv) * mb.mask).sum().backward()
        grads.append((logp.detach(), entropy, {n: p.grad.clone() for n, p in model.named_parameters()}))
        if path == "chunked":
            widest = max(t.numel() for t in r.created + r.saved if t.shape[-1:] == (vocab,))
            assert widest <= 16 * vocab < mb.input_ids.numel() * vocab
    (logp_a, ent_a, grad_a), (logp_b, ent_b, grad_b) = grads
    assert torch.allclose(logp_a, logp_b, atol=TOL[dtype]) and torch.allclose(ent_a, ent_b, atol=TOL[dtype])
    for n, g in grad_a.items():
        assert torch.allclose(g, grad_b[n], atol=TOL[dtype] * float(g.abs().max()) + 1e-8), n


def _micro_batch(width: int):
    """Two samples of `width` tokens, every token after the first trained."""
    import numpy as np

    mask = np.ones(width, np.float32)
    mask[0] = 0
    items = [Sample(np.arange(width) % 50, np.zeros(width, np.float32), mask, adv, 0) for adv in (1.0, -0.5)]
    return collate(items)

"""The hf engine's sampler: one [batch, vocab] tensor op chain on the logits' device, the same token for a
seeded row alone or in a batch, the distribution asked for, and logprobs of what was sampled from."""

from __future__ import annotations

import pytest

from astraflow.engines.base import SamplingParams
from astraflow.engines.sampling import Sampler

torch = pytest.importorskip("torch")


def mixed(n: int) -> list[SamplingParams]:
    """Greedy, plain, top-k, top-p and both, temperatures below and at 1."""
    kinds = [
        {"temperature": 0.0},
        {},
        {"top_k": 5},
        {"top_p": 0.8, "temperature": 0.7},
        {"top_k": 10, "top_p": 0.9},
    ]
    return [SamplingParams(seed=1000 + i, **kinds[i % len(kinds)]) for i in range(n)]


def test_a_batch_is_sampled_without_reading_the_logits_on_the_host():
    """On the meta device a tensor has no values: any copy to the host, `.item()` or loop over rows or
    vocabulary would raise. Sampling a batch of 64 rows over the Qwen2.5 vocabulary still works."""
    logits = torch.empty(64, 151_936, dtype=torch.bfloat16, device="meta")
    tokens, logprobs = Sampler.of(mixed(64), "meta")(logits, step=3)
    assert tokens.shape == logprobs.shape == (64,)
    assert tokens.device.type == logprobs.device.type == "meta"


def ten_rows(seed: int):
    """Logits of 10 rows over 40 tokens, their mixed sampling settings and the batch's sampler."""
    logits = 2 * torch.randn(10, 40, generator=torch.Generator().manual_seed(seed))
    return logits, mixed(10), Sampler.of(mixed(10), "cpu")


def test_a_seeded_row_gives_the_same_tokens_alone_or_in_a_batch():
    logits, params, batch = ten_rows(0)
    for step in range(6):
        together, _ = batch(logits, step)
        alone = [int(Sampler.of([p], "cpu")(logits[i : i + 1], step)[0]) for i, p in enumerate(params)]
        assert together.tolist() == alone
    steps = [int(batch(logits, s)[0][1]) for s in range(20)]
    assert len(set(steps)) > 1  # a new draw each step


def reference(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row's log-probabilities after the temperature, top-k, then top-p (renormalised each time)."""
    logp = torch.log_softmax(logits / (p.temperature or 1.0), -1)
    keep = torch.ones_like(logp, dtype=torch.bool)
    if 0 < p.top_k < len(logp):
        keep[logp.argsort(descending=True)[p.top_k :]] = False
        logp = torch.log_softmax(logp.masked_fill(~keep, -float("inf")), -1)
    if p.top_p < 1.0:
        mass = 0.0
        for j in logp.argsort(descending=True).tolist():
            if mass >= p.top_p:
                keep[j] = False
            mass += float(logp[j].exp())
        logp = torch.log_softmax(logp.masked_fill(~keep, -float("inf")), -1)
    return logp


def test_logprobs_are_those_of_the_distribution_sampled_from():
    logits, params, sampler = ten_rows(1)
    for step in range(5):
        tokens, logprobs = sampler(logits, step)
        for i, p in enumerate(params):
            expected = reference(logits[i], p)
            t = int(tokens[i])
            assert expected[t] > -float("inf")  # never a token the cuts removed
            assert float(logprobs[i]) == pytest.approx(float(expected[t]), abs=1e-5)
            if p.temperature == 0:
                assert t == int(logits[i].argmax())


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8), SamplingParams(top_k=3, top_p=0.7)])
def test_tokens_follow_the_distribution(params):
    """6,000 draws (1,000 seeds x 6 steps) of one row: each token's frequency is its probability."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    probs = reference(logits, params).exp()
    seeds = [SamplingParams(**{**params.__dict__, "seed": s}) for s in range(1000)]
    sampler = Sampler.of(seeds, "cpu")
    draws = torch.cat([sampler(logits.expand(1000, -1), step)[0] for step in range(6)])
    freq = torch.bincount(draws, minlength=6).double() / len(draws)
    assert torch.allclose(freq, probs.double(), atol=0.02)
    assert (freq[probs == 0] == 0).all()

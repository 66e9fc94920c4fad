"""Tokens are scored as they were sampled: the trainer's logprobs of a sample go through the temperature,
top-k and top-p its engine sampled with, so at the same weights they equal the engine's (prox = behav),
and every ratio and importance weight starts at 1 whatever the sampling settings."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from astraflow.engines.base import GenerateRequest, SamplingParams
from astraflow.messages import Batch, RolloutGroup, SampleGroup, pack, unpack
from astraflow.trainer.settings import LossSettings, TrainerSettings
from astraflow.workflows.rlvr import trajectory

torch = pytest.importorskip("torch")


async def sampled_group(engine, params: list[SamplingParams], prompt: list[int]) -> SampleGroup:
    """A group as the dataflow accepts it: the rlvr workflow's trajectories of `engine`'s samples."""
    responses = await asyncio.gather(*(engine.generate(GenerateRequest(prompt, p)) for p in params))
    rewards = np.arange(len(params), dtype=np.float32) % 2
    trajs = [trajectory("policy", prompt, r, float(w), None) for r, w in zip(responses, rewards, strict=True)]
    return SampleGroup(
        uid="g",
        model="policy",
        min_version=0,
        max_version=0,
        rollout=pack(RolloutGroup(uid="g", raas="r", version=0, trajectories=trajs)),
        indices=list(range(len(trajs))),
        advantages=(rewards - rewards.mean()).astype(np.float32),
    )


def proximal_gaps(tiny_model, group: SampleGroup, share_prefix: bool, monkeypatch) -> torch.Tensor:
    """|prox - behav| of every trained token of `group`, prox as the trainer computes it for the loss
    (`PolicyTrainer.step` with decoupled PPO, at the weights that sampled the group)."""
    from transformers import AutoModelForCausalLM

    from astraflow.trainer import losses
    from astraflow.trainer.step import PolicyTrainer

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    settings = TrainerSettings(share_prefix=share_prefix, loss=LossSettings(correction="decoupled"))
    trainer = PolicyTrainer(model, settings)
    seen: list[tuple] = []
    policy_loss = losses.policy_loss

    def spy(logp, behav, adv, mask, cfg, prox=None, *rest):
        seen.append((behav.detach().clone(), prox.detach().clone(), mask.clone()))
        return policy_loss(logp, behav, adv, mask, cfg, prox, *rest)

    monkeypatch.setattr(losses, "policy_loss", spy)
    trainer.step(Batch(uid="b", model="policy", version=0, groups=[group]))
    gaps = torch.cat([(prox - behav)[mask > 0].abs() for behav, prox, mask in seen])
    assert len(gaps) == sum(int(t.loss_mask.sum()) for t in group.trajectories)
    return gaps


@pytest.mark.parametrize(
    ("temperature", "top_p", "top_k", "share_prefix"),
    [(1.0, 0.9, 0, True), (0.7, 0.9, 0, True), (0.7, 0.9, 0, False), (0.7, 1.0, 8, True)],
)
async def test_the_trainers_proximal_logprobs_equal_the_engines_on_policy(
    tiny_model, monkeypatch, temperature, top_p, top_k, share_prefix
):
    """The hf engine samples at `temperature` with a top-p (or top-k) cut; the trainer, at the same weights,
    computes its proximal logprobs through its own code path (the values handed to the loss): they match
    the engine's to 1e-5 nats on average over the trained tokens."""
    from astraflow.engines.hf import HFEngine
    from astraflow.engines.settings import EngineSettings

    params = [
        SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=12, seed=40 + i)
        for i in range(6)
    ]
    engine = HFEngine(EngineSettings(type="hf", model=tiny_model))
    await engine.start()
    try:
        group = await sampled_group(engine, params, [5, 17, 42])
    finally:
        await engine.close()
    assert {(t.temperature, t.top_p, t.top_k) for t in group.trajectories} == {(temperature, top_p, top_k)}
    gaps = proximal_gaps(tiny_model, group, share_prefix, monkeypatch)
    assert float(gaps.mean()) < 1e-5, f"mean |prox - behav| = {float(gaps.mean()):.3g} nats"


def test_a_trajectory_written_before_the_sampling_fields_decodes_as_plain_sampling():
    """An entry of a RaaS that did not record its sampling (the fields missing on the wire) still decodes:
    plain sampling, which is what every run before them was scored as."""
    import msgpack

    from astraflow.messages import Trajectory

    traj = Trajectory(
        "policy",
        np.arange(4, dtype=np.int32),
        np.zeros(4, np.float32),
        np.ones(4, np.uint8),
        np.zeros(4, np.int32),
        1.0,
        temperature=0.7,
        top_k=5,
        top_p=0.9,
    )
    data = pack(RolloutGroup(uid="g", raas="r", version=0, trajectories=[traj]))
    plain = msgpack.unpackb(data, raw=False, ext_hook=msgpack.ExtType)
    for name in ("temperature", "top_k", "top_p"):
        del plain["trajectories"][name]
    old = msgpack.packb(plain, use_bin_type=True)
    (again,) = unpack(RolloutGroup, data).trajectories
    (before,) = unpack(RolloutGroup, old).trajectories
    assert (again.temperature, again.top_k, again.top_p) == (0.7, 5, 0.9)
    assert (before.temperature, before.top_k, before.top_p) == (1.0, 0, 1.0)
    assert before.token_ids.tolist() == [0, 1, 2, 3]


def test_processed_logprobs_have_the_value_and_gradient_of_a_masked_log_softmax():
    """The trainer's chunked logprobs under a row's temperature, top-k and top-p equal the log-softmax of
    the logits divided by the temperature over the tokens the cuts keep (`reference`, the sampler test's
    independent one), in value and gradient; a target the cuts remove is scored over the kept tokens and
    itself (finite)."""
    from astraflow.trainer.batching import target_logprobs
    from tests.unit.test_hf_sampling import reference

    g = torch.Generator().manual_seed(3)
    rows = [
        SamplingParams(0.7, 0.9),
        SamplingParams(1.3, 1.0, 6),
        SamplingParams(),
        SamplingParams(0.5, 0.8, 10),
    ]
    logits = (2 * torch.randn(len(rows), 7, 40, generator=g)).requires_grad_()
    targets = torch.randint(0, 40, (len(rows), 7), generator=g)
    weights = torch.randn(len(rows), 7, generator=g)
    sampling = (
        torch.tensor([p.temperature for p in rows]),
        torch.tensor([p.top_k for p in rows]),
        torch.tensor([p.top_p for p in rows]),
    )
    logp, _ = target_logprobs(logits, targets, chunk_rows=5, sampling=sampling)
    (logp * weights).sum().backward()
    got = logits.grad.clone()

    logits.grad = None
    expected = torch.zeros(len(rows), 7)
    for i, p in enumerate(rows):
        for j in range(7):
            x = logits[i, j]
            keep = reference(x.detach(), p) > -float("inf")
            keep[targets[i, j]] = True
            expected[i, j] = torch.log_softmax((x / p.temperature).masked_fill(~keep, -float("inf")), -1)[
                targets[i, j]
            ]
    (expected * weights).sum().backward()
    assert torch.isfinite(logp).all()
    assert torch.allclose(logp.detach(), expected.detach(), atol=1e-5)
    assert torch.allclose(got, logits.grad, atol=1e-5)


def test_a_multi_turn_trajectory_carries_its_turns_sampling_and_refuses_a_mix():
    """A transcript's trajectory says how its sampled turns were sampled; turns sampled differently cannot
    share one trajectory (the trainer scores a trajectory through one processing)."""
    from astraflow.engines.base import GenerateResponse
    from astraflow.workflows.transcript import Transcript

    def turn(params):
        return GenerateResponse([7, 8], [-0.1, -0.2], [0, 0], "stop", sampling=params)

    record = Transcript([1, 2])
    record.sampled(turn(SamplingParams(temperature=0.6, top_p=0.95)), 2)
    record.observed([3])
    record.sampled(turn(SamplingParams(temperature=0.6, top_p=0.95, max_new_tokens=8)), 1)
    traj = record.trajectory("policy", 1.0, "stop", None)
    assert (traj.temperature, traj.top_k, traj.top_p) == (0.6, 0, 0.95)
    with pytest.raises(ValueError, match="sampled alike"):
        record.sampled(turn(SamplingParams(temperature=1.0)), 2)

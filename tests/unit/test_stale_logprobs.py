"""The logprobs the loss sees on stale data are the right ones.

The real engine samples groups at versions 0 and 1 (version 1 served to it as the trainer publishes it,
in bfloat16, and loaded between pause and resume), the real trainer reaches version 2, then trains a
batch of those groups (staleness 2 and 1). What `policy_loss` receives is compared, token by token, with
an independent recomputation (one plain forward pass over each whole sequence):
- `behav` (the old logprobs) with the weights of the version that sampled each token, as the engine
  held them; not those of another version, and not shifted by a token;
- `prox` (decoupled PPO's proximal logprobs) with the trainer's weights before the batch's update, for
  every minibatch of the batch (a minibatch after the first must not see the weights the first one
  already moved).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from astraflow.engines.base import GenerateRequest, SamplingParams
from astraflow.messages import Batch, RolloutGroup, SampleGroup, pack
from astraflow.trainer.prefix import SharedMicroBatch
from astraflow.trainer.settings import LossSettings, TrainerSettings
from astraflow.workflows.rlvr import trajectory

torch = pytest.importorskip("torch")
TOL = 1e-4  # float32 incremental decoding, or a shared-prefix forward, against one full forward pass

pytestmark = pytest.mark.slow


def group(uid: str, prompt: list[int], responses, rewards: list[float]) -> SampleGroup:
    """A sample group as the dataflow accepts it: the rlvr workflow's trajectories of `responses`."""
    trajs = [trajectory("policy", prompt, r, w, None) for r, w in zip(responses, rewards, strict=True)]
    versions = np.concatenate([t.versions[t.loss_mask > 0] for t in trajs])
    r = np.array(rewards)
    return SampleGroup(
        uid=uid,
        model="policy",
        min_version=int(versions.min()),
        max_version=int(versions.max()),
        rollout=pack(RolloutGroup(uid=uid, raas="r", version=0, trajectories=trajs)),
        indices=list(range(len(trajs))),
        advantages=((r - r.mean()) / (r.std() + 1e-6)).astype(np.float32),
    )


async def sample(engine, prompt: list[int], seed: int, n: int = 6) -> list:
    params = [SamplingParams(temperature=1.0, max_new_tokens=5, seed=seed + i) for i in range(n)]
    import asyncio

    return list(await asyncio.gather(*(engine.generate(GenerateRequest(prompt, p)) for p in params)))


def served(model, path) -> dict:
    """Publish `model` as the trainer does (its state in the served dtype, bfloat16) into `path`; the
    weights an engine that loads them holds (float32 values of the bfloat16 ones)."""
    from safetensors.torch import save_file

    state = {k: v.detach().to(torch.bfloat16).clone() for k, v in model.state_dict().items()}
    path.mkdir()
    save_file(state, str(path / "model.safetensors"))
    return {k: v.float() for k, v in state.items()}


def with_weights(model, state: dict):
    copy_ = copy.deepcopy(model)
    copy_.load_state_dict(state)
    return copy_.eval()


def rows(mb) -> list[tuple[list[int], int, int]]:
    """Each row of a micro-batch as (its whole token sequence, index in it of the token its column 0
    predicts, columns): read back from the input tensors, plain or shared-prefix."""
    out = []
    if isinstance(mb, SharedMicroBatch):
        for j in range(mb.targets.shape[0]):
            prefix = mb.prefix_ids[mb.row[j]][mb.prefix_attention[mb.row[j]] > 0].tolist()
            n = int(mb.suffix_attention[j].sum()) + 1
            out.append((prefix + mb.targets[j, :n].tolist(), len(prefix), n))
        return out
    for j in range(mb.input_ids.shape[0]):
        seq = mb.input_ids[j][mb.attention_mask[j] > 0].tolist()
        out.append((seq, 1, len(seq) - 1))
    return out


def recomputed(model, mb, width: int) -> torch.Tensor:
    """[rows, width]: `model`'s logprob of the token each column predicts, from one plain forward pass
    over each whole sequence (0 past a row's end)."""
    out = torch.zeros(len(rows(mb)), width)
    with torch.no_grad():
        for j, (seq, first, n) in enumerate(rows(mb)):
            logp = torch.log_softmax(model(input_ids=torch.tensor([seq])).logits[0].float(), -1)
            for k in range(n):
                out[j, k] = logp[first + k - 1, seq[first + k]]
    return out


@pytest.mark.parametrize("share_prefix", [True, False])
@pytest.mark.parametrize("minibatches", [1, 2])
async def test_the_loss_sees_behaviour_logprobs_of_their_version_and_proximal_ones_of_now(
    tiny_model, tmp_path, monkeypatch, share_prefix, minibatches
):
    from transformers import AutoModelForCausalLM

    from astraflow.engines.hf import HFEngine
    from astraflow.engines.settings import EngineSettings
    from astraflow.trainer import losses
    from astraflow.trainer import step as step_module
    from astraflow.trainer.step import PolicyTrainer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    v0 = {k: v.clone() for k, v in model.state_dict().items()}  # the engine starts from the same files
    loss = LossSettings(correction="decoupled")
    settings = TrainerSettings(lr=2e-2, grad_clip=None, minibatches=minibatches, share_prefix=share_prefix)
    trainer = PolicyTrainer(model, settings.model_copy(update={"loss": loss}))
    rewards = [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]

    engine = HFEngine(EngineSettings(type="hf", model=tiny_model))
    await engine.start()
    try:
        old = group("old", [5, 17, 42], await sample(engine, [5, 17, 42], seed=10), rewards)  # version 0
        first = group("first", [6, 18, 43], await sample(engine, [6, 18, 43], seed=20), rewards)
        trainer.step(Batch(uid="b1", model="policy", version=0, groups=[first]))  # -> version 1
        v1 = served(model, tmp_path / "v1")
        await engine.pause()
        await engine.load_weights(str(tmp_path / "v1"), 1)
        await engine.resume()
        newer = group("newer", [7, 19], await sample(engine, [7, 19], seed=30), rewards)  # version 1
        trainer.step(Batch(uid="b2", model="policy", version=1, groups=[newer]))  # -> version 2
    finally:
        await engine.close()
    assert (old.min_version, old.max_version, newer.min_version, newer.max_version) == (0, 0, 1, 1)

    seen: list[tuple] = []
    forward = step_module.token_logprobs
    policy_loss = losses.policy_loss
    current: dict = {}

    def spy_forward(m, mb, **kw):
        current["mb"] = mb
        return forward(m, mb, **kw)

    def spy_loss(logp, behav, adv, mask, cfg, prox=None, *rest):
        seen.append((current["mb"], behav.detach().clone(), prox.detach().clone(), mask.clone()))
        return policy_loss(logp, behav, adv, mask, cfg, prox, *rest)

    monkeypatch.setattr(step_module, "token_logprobs", spy_forward)
    monkeypatch.setattr(losses, "policy_loss", spy_loss)
    before = with_weights(model, model.state_dict())  # the trainer's weights before the stale batch
    stats = trainer.step(Batch(uid="b3", model="policy", version=2, groups=[old, newer]))
    assert stats["staleness_max"] == 2 and stats["staleness_mean"] == 1.5

    behaviour = {0: with_weights(model, v0), 1: with_weights(model, v1)}
    version_of = {tuple(t.token_ids.tolist()): v for g, v in ((old, 0), (newer, 1)) for t in g.trajectories}
    checked = {0: 0, 1: 0}
    for mb, behav, prox, mask in seen:
        width = mask.shape[1]
        now = recomputed(before, mb, width)
        on = mask > 0
        assert torch.allclose(prox[on], now[on], atol=TOL), "proximal logprobs are not the trainer's before"
        for j, (seq, _, _) in enumerate(rows(mb)):
            v = version_of[tuple(seq)]
            mine = recomputed(behaviour[v], mb, width)[j]
            other = recomputed(behaviour[1 - v], mb, width)[j]
            at = on[j]
            assert torch.allclose(behav[j][at], mine[at], atol=TOL), f"behaviour logprobs not of version {v}"
            # The check can tell versions and positions apart: another version's weights, or the same
            # logprobs one token off, would not pass it.
            assert (behav[j][at] - other[at]).abs().max() > 10 * TOL
            if int(at.sum()) > 1:
                assert (behav[j][at][1:] - mine[at][:-1]).abs().max() > 10 * TOL
            checked[v] += 1
    assert checked == {0: 6, 1: 6}

"""Each loss of the family against a hand computation on small tensors."""

import math

import pytest
import torch

from astraflow.dataflow.checks import LOGPROB_FLOOR
from astraflow.trainer.losses import kl_estimate, m2po_keep, policy_loss
from astraflow.trainer.settings import LossSettings

L = math.log


def t(*rows):
    return torch.tensor(rows, dtype=torch.float64)


def loss_of(logp, behav, adv, mask, **kw):
    cfg_keys = set(LossSettings.model_fields)
    cfg = LossSettings(**{k: v for k, v in kw.items() if k in cfg_keys})
    extra = {k: v for k, v in kw.items() if k not in cfg_keys}
    return policy_loss(logp, behav, adv, mask, cfg, **extra)


def test_asymmetric_clip_by_hand():
    # ratios 0.5, 1.0, 1.5 (behav = 0), advantages +1 and -1, clip 0.2 below, 0.28 above
    logp = t([L(0.5), 0.0, L(1.5)], [L(0.5), 0.0, L(1.5)])
    adv = t([1.0, 1.0, 1.0], [-1.0, -1.0, -1.0])
    mask = torch.ones(2, 3)
    loss, stats = loss_of(
        logp, torch.zeros(2, 3, dtype=torch.float64), adv, mask, clip_low=0.2, clip_high=0.28
    )
    # A=+1: max(-r, -clip(r)) = -0.5, -1, -1.28 ; A=-1: max(r, clip(r)) = 0.8, 1, 1.5
    expected = (-0.5 - 1 - 1.28 + 0.8 + 1 + 1.5) / 6
    assert loss.item() == pytest.approx(expected)
    assert stats["clip_frac"] == pytest.approx(2 / 6)  # A=+1 at 1.5, A=-1 at 0.5


def test_dual_clip_caps_negative_advantage_losses():
    logp, behav = t([L(5.0), L(5.0)]), t([0.0, 0.0])
    adv, mask = t([-1.0, 1.0]), torch.ones(1, 2)
    loss, _ = loss_of(logp, behav, adv, mask, dual_clip=3.0)
    # A=-1: max(5, 1.2) = 5, capped at 3 ; A=+1: max(-5, -1.2) = -1.2
    assert loss.item() == pytest.approx((3.0 - 1.2) / 2)


def test_decoupled_ppo_clips_around_proximal_and_truncates_the_behaviour_weight():
    logp = t([L(1.5), L(1.1)])
    prox = t([0.0, 0.0])
    behav = t([L(0.25), L(1.0)])  # w = prox / behav = 4 (truncated to 2), 1
    adv, mask = t([1.0, 1.0]), torch.ones(1, 2)
    loss, stats = loss_of(logp, behav, adv, mask, prox=prox, decoupled=True, is_cap=2.0)
    # ratios vs prox 1.5 (clipped to 1.2) and 1.1 ; weights 2 and 1
    assert loss.item() == pytest.approx((-1.2 * 2 - 1.1 * 1) / 2)
    assert stats["is_weight_max"] == pytest.approx(2.0)


def test_tis_weights_and_icepop_drops_mismatched_tokens():
    logp = t([0.0, 0.0, 0.0])
    behav = t([L(0.25), 0.0, L(4.0)])  # engine probs; trainer (prox) probs all 1 -> w = 4, 1, 0.25
    prox = t([0.0, 0.0, 0.0])
    adv, mask = t([1.0, 1.0, 1.0]), torch.ones(1, 3)
    # ratio vs behav: 4 (clipped 1.2), 1, 0.25 -> per-token -A*clip... for A=+1: max(-r, -clip(r))
    base = [-1.2, -1.0, -0.25]
    tis, _ = loss_of(logp, behav, adv, mask, prox=prox, correction="tis", is_cap=2.0)
    assert tis.item() == pytest.approx((base[0] * 2 + base[1] * 1 + base[2] * 0.25) / 3)
    ice, stats = loss_of(
        logp, behav, adv, mask, prox=prox, correction="icepop", icepop_low=0.5, icepop_high=2
    )
    assert ice.item() == pytest.approx(base[1] / 3)  # only the middle token is kept; denominator stays 3
    assert stats["dropped_frac"] == pytest.approx(2 / 3)


def test_m2po_drops_the_largest_second_moments_first():
    sq = t([0.25, 0.01, 0.0, 0.09])
    keep = m2po_keep(sq, torch.ones(1, 4, dtype=torch.float64), threshold=0.05)
    assert keep.tolist() == [[0.0, 1.0, 1.0, 1.0]]  # mean of the rest 0.033 <= 0.05
    keep = m2po_keep(sq, torch.ones(1, 4, dtype=torch.float64), threshold=0.02)
    assert keep.tolist() == [[0.0, 1.0, 1.0, 0.0]]
    assert m2po_keep(sq, torch.ones(1, 4, dtype=torch.float64), threshold=1.0).tolist() == [[1.0] * 4]


def test_kl_estimators_by_hand():
    logp, ref = t([0.0]), t([L(0.5)])  # d = ref - logp = log 0.5
    d = L(0.5)
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(-d)
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(0.5 * d * d)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(0.5 - d - 1)


def test_kl_penalty_is_added_per_token():
    logp, behav, ref = t([0.0, 0.0]), t([0.0, 0.0]), t([L(0.5), 0.0])
    adv, mask = t([0.0, 0.0]), torch.ones(1, 2)
    loss, stats = loss_of(logp, behav, adv, mask, ref=ref, kl_coef=0.1, kl_estimator="k3")
    assert loss.item() == pytest.approx(0.1 * (0.5 - L(0.5) - 1) / 2)
    assert stats["kl"] == pytest.approx((0.5 - L(0.5) - 1) / 2)


def test_sequence_level_ratio_is_the_geometric_mean():
    logp = t([L(2.0), L(0.5)])  # token ratios 2 and 0.5: sequence ratio 1
    adv, mask = t([1.0, 1.0]), torch.ones(1, 2)
    loss, _ = loss_of(logp, t([0.0, 0.0]), adv, mask, ratio_level="sequence")
    assert loss.item() == pytest.approx(-1.0)


def test_token_mean_and_sequence_mean_differ_on_uneven_lengths():
    logp = torch.zeros(2, 3, dtype=torch.float64)
    adv = t([1.0, 1.0, 1.0], [3.0, 3.0, 3.0])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.float64)
    tok, _ = loss_of(logp, logp, adv, mask)
    seq, _ = loss_of(logp, logp, adv, mask, aggregation="sequence_mean")
    assert tok.item() == pytest.approx(-(1 + 1 + 1 + 3) / 4)
    assert seq.item() == pytest.approx(-(1 + 3) / 2)
    half, _ = loss_of(logp, logp, adv, mask, denominator=8.0)  # part of a larger minibatch
    assert half.item() == pytest.approx(-(1 + 1 + 1 + 3) / 8)


def test_masked_tokens_get_no_gradient():
    logp = torch.zeros(1, 3, dtype=torch.float64, requires_grad=True)
    loss, _ = loss_of(logp, torch.zeros(1, 3, dtype=torch.float64), t([1.0, 1.0, 1.0]), t([1.0, 0.0, 1.0]))
    loss.backward()
    assert logp.grad[0, 1] == 0 and logp.grad[0, 0] != 0


def test_corrections_need_the_proximal_logprobs():
    with pytest.raises(ValueError, match="proximal"):
        loss_of(t([0.0]), t([0.0]), t([1.0]), t([1.0]), decoupled=True)


@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_a_logprob_at_the_collectors_floor_keeps_the_loss_and_its_gradient_finite(ratio_level):
    """A token whose sampling logprob is as low as the collector lets through (-1e4) beside ordinary ones:
    every advantage sign gives a finite loss and finite gradients, so no batch is set aside for it."""
    behav = torch.full((3, 4), -0.5)
    behav[:, 1] = LOGPROB_FLOOR
    logp = torch.full((3, 4), -0.7, requires_grad=True)
    adv = t([1.0] * 4, [-1.0] * 4, [0.0] * 4).float()
    loss, _ = loss_of(logp, behav, adv, torch.ones(3, 4), ratio_level=ratio_level)
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(logp.grad).all()

"""Each loss of the family against a hand computation on small tensors."""

import math

import numpy as np
import pytest
import torch

from astraflow.dataflow.checks import LOGPROB_FLOOR
from astraflow.trainer.losses import CORRECTIONS, denominator, kl_estimate, m2po_keep, policy_loss
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


def grad_of(logp, behav, adv, mask, **kw):
    """The loss and its gradient with respect to `logp` (d loss / d log pi of each token)."""
    logp = logp.clone().requires_grad_()
    loss, stats = loss_of(logp, behav, adv, mask, **kw)
    loss.backward()
    return loss, logp.grad, stats


# A hand-built batch of four trained tokens, advantage +1: the trainer's proximal logprobs are 0 (p = 1),
# the engine's give w = prox / behav = 4, 1, 0.25 and 8; the policy moved to r_prox = 1.1, 1, 1, 0.9.
PROX = t([0.0, 0.0, 0.0, 0.0])
BEHAV = t([L(0.25), 0.0, L(4.0), L(0.125)])
W = [4.0, 1.0, 0.25, 8.0]
LOGP = t([L(1.1), 0.0, 0.0, L(0.9)])
R_PROX = [1.1, 1.0, 1.0, 0.9]
ADV, MASK = t([1.0, 1.0, 1.0, 1.0]), torch.ones(1, 4)


def test_ppo_without_a_correction_takes_the_ratio_to_the_engines_logprobs():
    """-A r grad log pi with r = pi / pi_behav, and 0 where the clip binds (r = 4.4 and 7.2 above 1.2)."""
    _, grad, stats = grad_of(LOGP, BEHAV, ADV, MASK)
    r = [rp * w for rp, w in zip(R_PROX, W, strict=True)]  # 4.4, 1, 0.25, 7.2
    expected = [0.0 if x > 1.2 else -x / 4 for x in r]
    assert grad[0].tolist() == pytest.approx(expected)
    assert stats["clip_frac"] == pytest.approx(2 / 4)


@pytest.mark.parametrize(
    ("cap", "mode", "weights"),
    [
        (None, "drop", W),  # AReaL's default: no cap
        (2.0, "clamp", [2.0, 1.0, 0.25, 2.0]),  # min(w, cap)
        (2.0, "drop", [0.0, 1.0, 0.25, 0.0]),  # 0 above the cap
    ],
)
def test_decoupled_ppo_weights_the_proximal_ratio_by_the_behaviour_weight(cap, mode, weights):
    """-A w' r_prox grad log pi, w' the (capped) behaviour weight, while r_prox is inside the clip."""
    loss, grad, stats = grad_of(
        LOGP, BEHAV, ADV, MASK, prox=PROX, correction="decoupled", decoupled_cap=cap, decoupled_cap_mode=mode
    )
    assert grad[0].tolist() == pytest.approx([-w * r / 4 for w, r in zip(weights, R_PROX, strict=True)])
    assert loss.item() == pytest.approx(sum(-w * r for w, r in zip(weights, R_PROX, strict=True)) / 4)
    assert stats["dropped_frac"] == pytest.approx(weights.count(0.0) / 4)


def test_decoupled_ppo_clips_around_the_proximal_policy():
    logp = t([L(1.5), L(1.1)])  # r_prox 1.5 (clipped at 1.2: no gradient) and 1.1
    loss, grad, _ = grad_of(
        logp, t([L(0.25), 0.0]), t([1.0, 1.0]), torch.ones(1, 2), prox=t([0.0, 0.0]), correction="decoupled"
    )
    assert loss.item() == pytest.approx((-1.2 * 4 - 1.1 * 1) / 2)
    assert grad[0].tolist() == pytest.approx([0.0, -1.1 / 2])


def test_tis_weights_the_trainers_ratio_once_by_the_truncated_engine_weight():
    """-A min(w, 2) r_prox grad log pi. On policy (pi = pi_prox) that is -A min(w, 2): the weight counted
    once, not w x min(w, 2) as a ratio to the engine's logprobs times the weight would give."""
    _, grad, stats = grad_of(LOGP, BEHAV, ADV, MASK, prox=PROX, correction="tis", tis_cap=2.0)
    capped = [min(w, 2.0) for w in W]
    assert grad[0].tolist() == pytest.approx([-c * r / 4 for c, r in zip(capped, R_PROX, strict=True)])
    _, on_policy, _ = grad_of(PROX, BEHAV, ADV, MASK, prox=PROX, correction="tis", tis_cap=2.0)
    assert on_policy[0].tolist() == pytest.approx([-c / 4 for c in capped])
    assert stats["is_weight_max"] == pytest.approx(2.0)


def test_icepop_weights_by_the_mismatch_and_masks_it_outside_its_bounds():
    """-A w r_prox grad log pi where 0.5 <= w <= 5 (IcePop's alpha and beta), 0 elsewhere (w = 0.25, 8)."""
    loss, grad, stats = grad_of(LOGP, BEHAV, ADV, MASK, prox=PROX, correction="icepop")
    weights = [4.0, 1.0, 0.0, 0.0]
    assert grad[0].tolist() == pytest.approx([-w * r / 4 for w, r in zip(weights, R_PROX, strict=True)])
    assert loss.item() == pytest.approx((-4.0 * 1.1 - 1.0) / 4)  # the denominator keeps the masked tokens
    assert stats["dropped_frac"] == pytest.approx(2 / 4)


def test_m2po_masks_the_largest_second_moments_and_does_not_clip():
    """-A r grad log pi with r = pi / pi_behav unclipped (4.4 stays 4.4) on the tokens M2PO keeps: (log w)^2
    = 1.92, 0, 1.92, 4.32; dropping the largest leaves a mean of 1.28 <= 2."""
    loss, grad, stats = grad_of(LOGP, BEHAV, ADV, MASK, prox=PROX, correction="m2po", m2po_threshold=2.0)
    keep = [1.0, 1.0, 1.0, 0.0]
    r = [rp * w for rp, w in zip(R_PROX, W, strict=True)]
    assert grad[0].tolist() == pytest.approx([-k * x / 4 for k, x in zip(keep, r, strict=True)])
    assert loss.item() == pytest.approx(-(4.4 + 1.0 + 0.25) / 4)
    assert stats["clip_frac"] == 0.0 and stats["dropped_frac"] == pytest.approx(1 / 4)


def test_m2po_drops_the_largest_second_moments_first():
    sq = t([0.25, 0.01, 0.0, 0.09])
    keep = m2po_keep(sq, torch.ones(1, 4, dtype=torch.float64), threshold=0.05)
    assert keep.tolist() == [[0.0, 1.0, 1.0, 1.0]]  # mean of the rest 0.033 <= 0.05
    keep = m2po_keep(sq, torch.ones(1, 4, dtype=torch.float64), threshold=0.02)
    assert keep.tolist() == [[0.0, 1.0, 1.0, 0.0]]
    assert m2po_keep(sq, torch.ones(1, 4, dtype=torch.float64), threshold=1.0).tolist() == [[1.0] * 4]


def test_every_correction_is_registered_under_its_settings_name():
    names = set(LossSettings.model_fields["correction"].annotation.__args__)
    assert set(CORRECTIONS) == names
    with pytest.raises(ValueError, match="icepop_low"):
        LossSettings(icepop_low=2.0, icepop_high=1.0)


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


@pytest.mark.parametrize("name", ["decoupled", "tis", "icepop", "m2po"])
def test_corrections_need_the_proximal_logprobs(name):
    with pytest.raises(ValueError, match="proximal"):
        loss_of(t([0.0]), t([0.0]), t([1.0]), t([1.0]), correction=name)


FLOOR_CASES = [
    {"correction": "none"},
    {"correction": "decoupled"},
    {"correction": "decoupled", "decoupled_cap": 2.0, "decoupled_cap_mode": "drop"},
    {"correction": "decoupled", "decoupled_cap": 2.0, "decoupled_cap_mode": "clamp"},
    {"correction": "tis"},
    {"correction": "icepop"},
    {"correction": "m2po"},
]


@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
@pytest.mark.parametrize("cfg", FLOOR_CASES, ids=lambda c: "-".join(map(str, c.values())))
def test_a_logprob_at_the_collectors_floor_keeps_the_loss_and_its_gradient_finite(ratio_level, cfg):
    """A token whose sampling logprob is as low as the collector lets through (-1e4) beside ordinary ones:
    every loss and advantage sign gives a finite loss and finite gradients, so no batch is set aside."""
    behav = torch.full((3, 4), -0.5)
    behav[:, 1] = LOGPROB_FLOOR
    logp = torch.full((3, 4), -0.7, requires_grad=True)
    adv = t([1.0] * 4, [-1.0] * 4, [0.0] * 4).float()
    prox = torch.full((3, 4), -0.6)
    loss, _ = loss_of(logp, behav, adv, torch.ones(3, 4), ratio_level=ratio_level, prox=prox, **cfg)
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(logp.grad).all()


def test_the_denominator_counts_trained_tokens_or_sequences():
    masks = [np.ones(300, np.uint8), np.zeros(4, np.uint8), np.array([0, 1, 0], np.uint8)]
    assert denominator(LossSettings(aggregation="token_mean"), masks) == 301  # (uint8 sums do not wrap)
    assert denominator(LossSettings(aggregation="sequence_mean"), masks) == 2

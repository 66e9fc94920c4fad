"""The collector refuses rollouts with values no trainer may take (NaN or infinite rewards or logprobs,
positive logprobs, token ids outside the policy's vocabulary, token versions below 0 or far past the
newest): each is dead-lettered with its reason and counted dead, the ledger balances, and the good
groups around it are batched with finite values only. On fakeredis."""

from __future__ import annotations

import dataclasses
import json
import math

import fakeredis
import numpy as np
import pytest

from astraflow.dataflow import checks
from astraflow.dataflow.checks import VERSIONS_AHEAD, InvalidRollout, check_groups, check_values
from astraflow.dataflow.ledger import read_ledger
from astraflow.dataflow.service import Dataflow
from astraflow.launch.build import dataflow_setup
from astraflow.messages import PromptGroup, RolloutGroup, Trajectory, decode, encode
from astraflow.settings_load import load_settings
from astraflow.streams import Bus, Keys, Out
from astraflow.streams.keys import GROUP_RAAS
from tests.dataflow_helpers import publish_version, train, trajectory

VOCAB = 64
BASE = ["run.name=t", "dataflow.feeder.n_samples=4", "dataflow.dataset.size=50", "dataflow.batch.size=8"]


def make(tmp_path, *overrides: str) -> tuple[Bus, Dataflow]:
    """A dataflow whose policy's starting weights have a vocabulary of VOCAB tokens."""
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": VOCAB}))
    settings = load_settings(
        None, [*BASE, "run.models=['policy']", "dataflow.feeder.min_backlog=3", *overrides]
    )
    setup = dataclasses.replace(dataflow_setup(settings), model_paths={"policy": str(tmp_path)})
    server = fakeredis.FakeServer(version=(7, 0))
    client = fakeredis.FakeAsyncRedis(server=server, protocol=2)
    bus = Bus(Keys("t"), settings.streams, client, client, reconnect_max_s=1)
    return bus, Dataflow(setup, bus, "df")


async def hand_back(bus: Bus, spoil=None) -> str:
    """Roll out one prompt group as a RaaS (rewards 0, 1, 0, 1 at version 0), `spoil` changing its
    trajectories first; returns its uid."""
    [entry] = await bus.read(bus.keys.prompts, GROUP_RAAS, "raas-sim", 1, None)
    group = decode(entry.fields, PromptGroup)
    trajs = [trajectory("policy", float(i % 2), 0) for i in range(group.n_samples)]
    if spoil is not None:
        trajs = [spoil(t) if i == 1 else t for i, t in enumerate(trajs)]
    rollout = RolloutGroup(uid=group.uid, raas="raas-sim", version=0, trajectories=trajs, models=["policy"])
    await bus.handoff(
        bus.keys.prompts, GROUP_RAAS, "raas-sim", [(entry, [Out(bus.keys.rollouts, encode(rollout))])]
    )
    return group.uid


def setting(name: str, value):
    return lambda t: dataclasses.replace(t, **{name: value(t)})


def at_one(values: np.ndarray, value) -> np.ndarray:
    out = values.copy()
    out[-1] = value
    return out


SPOILED = {
    "nan_reward": (setting("reward", lambda t: math.nan), "reward nan is not finite"),
    "infinite_reward": (setting("reward", lambda t: -math.inf), "reward -inf is not finite"),
    "nan_logprob": (setting("logprobs", lambda t: at_one(t.logprobs, np.nan)), "logprobs are not finite"),
    "positive_logprob": (setting("logprobs", lambda t: at_one(t.logprobs, 3.0)), "logprob 3.0 > 0"),
    # Finite, but past what any sampler draws or any reward gives (issue 41: -1e30 set a batch aside,
    # a reward of 1e12 ended a run as "reward target reached").
    "logprob_below_the_floor": (
        setting("logprobs", lambda t: at_one(t.logprobs, -1e30)),
        "logprob -1e+30 < the floor -10000",
    ),
    "huge_reward": (
        setting("reward", lambda t: 1e12),
        "reward 1000000000000.0 outside the recipe's collector.reward_range [-1, 1]",
    ),
    "escape_codes_in_a_metric_name": (
        setting("metrics", lambda t: {"\x1b[2J\x1b[31mwin": 1.0}),
        "metric name '\\x1b[2J\\x1b[31mwin' is not",
    ),
    "too_many_metrics": (
        setting("metrics", lambda t: {f"m{i}": 1.0 for i in range(500)}),
        "500 metrics (at most 32)",
    ),
    # The trainer scores tokens through the sampling they say they were drawn with (issue 44).
    "tiny_temperature": (setting("temperature", lambda t: 1e-30), "temperature 1e-30 outside 0 or"),
    "nan_temperature": (setting("temperature", lambda t: math.nan), "temperature nan outside"),
    "negative_top_k": (setting("top_k", lambda t: -1), "top_k -1 outside"),
    "top_p_past_one": (setting("top_p", lambda t: 7.0), "top_p 7.0 outside [0, 1]"),
    "token_past_vocab": (
        setting("token_ids", lambda t: at_one(t.token_ids, VOCAB)),
        f"token id {VOCAB} outside the vocabulary [0, {VOCAB})",
    ),
    "negative_token": (setting("token_ids", lambda t: at_one(t.token_ids, -5)), "token id -5 outside"),
    "negative_version": (
        setting("versions", lambda t: at_one(t.versions, -2)),
        "token version -2 < 0 on a trained token",
    ),
    "version_from_the_future": (
        setting("versions", lambda t: at_one(t.versions, 2**31 - 1)),
        f"token version {2**31 - 1} > newest version 3 + {VERSIONS_AHEAD}",
    ),
}


@pytest.mark.parametrize("case", list(SPOILED))
async def test_a_rollout_with_bad_values_is_dead_lettered_with_its_reason_and_counted_dead(tmp_path, case):
    spoil, reason = SPOILED[case]
    bus, df = make(tmp_path)
    await bus.bootstrap(["policy"])
    await publish_version(bus, "policy", 3)
    await df.barrier.step(1)  # the dataflow records version 3: the newest
    await df.feeder.step()
    good = [await hand_back(bus), await hand_back(bus)]
    bad = await hand_back(bus, spoil)
    while await df.collector.step(1):
        pass
    [(_, dead)] = await bus.redis.xrange(bus.keys.dead)
    assert dead[b"field.uid"].decode() == bad
    assert dead[b"reason"].decode().startswith("InvalidRollout: trajectory 1 (policy): ")
    assert reason in dead[b"reason"].decode()
    while await df.former.step("policy") == "ok":
        pass
    [(_, batch)] = await train(bus, "policy")
    assert sorted(g.uid for g in batch.groups) == sorted(good)
    for g in batch.groups:
        assert np.isfinite(g.advantages).all()
        assert all(math.isfinite(t.reward) and np.isfinite(t.logprobs).all() for t in g.trajectories)
    ledger = await read_ledger(bus, ["policy"])
    assert not ledger.problems(), ledger.render()
    assert (ledger.submitted, ledger.dead, ledger.models["policy"].trained) == (3, 1, 2)


@pytest.mark.parametrize("normalize", ["none", "leave_one_out"])
async def test_finite_rewards_whose_advantages_overflow_are_refused_not_batched_as_inf(tmp_path, normalize):
    wide = "dataflow.collector.reward_range=[-1e40,1e40]"
    bus, df = make(tmp_path, f"dataflow.collector.normalize={normalize}", wide)
    await bus.bootstrap(["policy"])
    await df.feeder.step()
    bad = await hand_back(bus, setting("reward", lambda t: 1e39))  # finite, past float32's range
    await df.collector.step(1)
    [(_, dead)] = await bus.redis.xrange(bus.keys.dead)
    assert dead[b"field.uid"].decode() == bad
    assert "InvalidRollout: advantages of policy are not finite" in dead[b"reason"].decode()
    ledger = await read_ledger(bus, ["policy"])
    assert not ledger.problems(), ledger.render()
    assert ledger.dead == 1


def test_the_vocabulary_is_read_from_the_policy_model_config(tiny_model):
    settings = load_settings(None, [*BASE, f"engine.model={tiny_model}"])
    bus = Bus(Keys("t"), settings.streams, fakeredis.FakeAsyncRedis(), fakeredis.FakeAsyncRedis())
    df = Dataflow(dataflow_setup(settings), bus, "df")
    with open(f"{tiny_model}/config.json") as f:
        assert df.collector.vocab == {"policy": json.load(f)["vocab_size"]}


@pytest.mark.parametrize("travelled", [True, False], ids=["decoded", "built"])
def test_only_the_trajectories_that_did_not_fail_are_checked_and_the_bad_one_is_named(travelled):
    """A failed trajectory's values are not checked (it is not trained), so a group with one in its
    middle is checked by the others alone, read from the decoded columns or from the trajectories."""
    failed = dataclasses.replace(
        trajectory("policy", 0.0, 3), error="timeout", logprobs=np.full(8, np.nan, np.float32)
    )
    past = dataclasses.replace(trajectory("policy", 1.0, 3), token_ids=np.full(8, VOCAB, np.int32))

    def group(*trajs):
        built = RolloutGroup(uid="u", raas="w", version=3, trajectories=list(trajs), models=["policy"])
        return decode(encode(built), RolloutGroup) if travelled else built

    check_values(
        group(trajectory("policy", 0.0, 3), failed, trajectory("policy", 1.0, 3)), {}, {"policy": VOCAB}
    )
    with pytest.raises(InvalidRollout, match=rf"trajectory 2 \(policy\): token id {VOCAB} outside"):
        check_values(group(trajectory("policy", 0.0, 3), failed, past), {}, {"policy": VOCAB})
    with pytest.raises(InvalidRollout, match=r"trajectory 1 \(policy\): logprobs are not finite"):
        check_values(group(trajectory("policy", 0.0, 3), dataclasses.replace(failed, error=None)), {}, {})


def _travelled(*trajs: Trajectory, uid: str = "u") -> RolloutGroup:
    models = sorted({t.model for t in trajs})
    built = RolloutGroup(uid=uid, raas="w", version=3, trajectories=list(trajs), models=models)
    return decode(encode(built), RolloutGroup)


def _outcome(check):
    try:
        return check()
    except Exception as e:
        return (type(e).__name__, str(e))


def test_a_read_is_checked_together_with_what_each_group_alone_would_get(monkeypatch):
    """`check_groups` checks the groups of one read together; per group it returns (or holds the error)
    exactly what `check_values` gives that group alone: the versions of each, and the bad one named."""
    good = [trajectory("policy", float(i % 2), 3 + i % 2) for i in range(4)]
    untrained = dataclasses.replace(trajectory("policy", 1.0, 3), loss_mask=np.zeros(8, np.uint8))
    failed = dataclasses.replace(trajectory("policy", 0.0, 3), error="timeout", reward=math.nan)
    reads = [
        [_travelled(*good), _travelled(*good[:2]), _travelled(untrained, untrained)],
        [_travelled(*good), _travelled(good[0], failed), _travelled(good[0], trajectory("other", 1.0, 7))],
        [_travelled(*good, trajectory("policy", 1.0, 900, metrics={"m": 2.0})), _travelled(untrained)],
    ]
    for spoil, _ in SPOILED.values():
        reads.append([_travelled(*good), _travelled(good[0], spoil(good[1])), _travelled(*good[1:])])
    newest, vocab = {"policy": 3, "other": 5}, {"policy": VOCAB}
    for groups in reads:
        together = [_outcome(lambda o=o: _raised(o)) for o in check_groups(groups, newest, vocab)]
        alone = [_outcome(lambda g=g: check_values(g, newest, vocab)) for g in groups]
        assert together == alone

    calls = []
    monkeypatch.setattr(checks, "check_values", lambda *a: calls.append(1) or check_values(*a))
    check_groups(reads[0], newest, vocab)
    assert calls == []  # one policy, none failed: all at once
    check_groups(reads[3], newest, vocab)
    assert len(calls) == 3  # one of them bad: each alone, to name it


def _raised(outcome):
    if isinstance(outcome, Exception):
        raise outcome
    return outcome

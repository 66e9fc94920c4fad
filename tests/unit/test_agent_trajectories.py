"""An agent episode's calls as trajectories: merged where a prompt extends the previous turn, the reward
discounted for earlier trajectories."""

from astraflow.agents.recording import Call
from astraflow.engines.base import GenerateResponse, SamplingParams
from astraflow.workflows.agent_trajectories import trajectories


def call(seq, prompt, completion, version=2, model="policy", sampling=None):
    n = len(completion)
    resp = GenerateResponse(completion, [-0.1] * n, [version] * n, "stop", sampling=sampling)
    return Call(seq, model, prompt, resp)


def test_a_prompt_that_extends_the_last_turn_joins_its_trajectory():
    calls = [call(1, [1, 2, 3, 4, 5, 9, 9, 6], [7], version=3), call(0, [1, 2], [3, 4], version=2)]
    [traj] = trajectories(calls, reward=1.0)  # (taken in the order they arrived, not finished)
    assert traj.token_ids.tolist() == [1, 2, 3, 4, 5, 9, 9, 6, 7]
    assert traj.loss_mask.tolist() == [0, 0, 1, 1, 0, 0, 0, 0, 1]
    assert traj.versions.tolist() == [-1, -1, 2, 2, -1, -1, -1, -1, 3]


def test_earlier_trajectories_get_the_discounted_reward():
    calls = [
        call(0, [1], [2]),
        call(1, [5], [6]),
        call(2, [5, 6, 7], [8]),
        call(3, [5, 6], [8], model="other"),
    ]
    made = trajectories(calls, reward=1.0, discount=0.5, metrics={"calls": 4.0})
    assert [(t.model, t.reward) for t in made] == [("policy", 0.25), ("policy", 0.5), ("other", 1.0)]
    assert made[1].loss_mask.tolist() == [0, 1, 0, 1] and made[0].metrics == {"calls": 4.0}


def test_a_turn_sampled_otherwise_starts_its_own_trajectory():
    """The trainer scores a trajectory through one temperature/top-k/top-p: an agent that changes its
    sampling between turns gets one trajectory per processing, each carrying its own, never a crash."""
    hot = SamplingParams(temperature=0.7, top_p=0.9)
    calls = [call(0, [1], [2], sampling=hot), call(1, [1, 2, 3], [4]), call(2, [1, 2, 3, 4, 5], [6])]
    made = trajectories(calls, reward=1.0)
    assert [(t.temperature, t.top_p) for t in made] == [(0.7, 0.9), (1.0, 1.0)]
    assert made[1].token_ids.tolist() == [1, 2, 3, 4, 5, 6] and made[1].loss_mask.tolist() == [
        0,
        0,
        0,
        1,
        0,
        1,
    ]

"""A user's own workflow and rewards, loaded by `module:Name` as a recipe would name them."""

import time

import numpy as np

from astraflow.messages import Trajectory
from astraflow.workflows.api import EpisodeResult, RolloutWorkflow


def slow(prompt, completion, **sample):
    time.sleep(float(sample.get("sleep_s", 2.0)))
    return 1.0


def boom(prompt, completion, **sample):
    raise ValueError("reward exploded")


def hang(prompt, completion, **sample):
    while True:
        time.sleep(1)


class Echo(RolloutWorkflow):
    """Makes no engine call: the trajectory is the prompt's bytes, rewarded 0.5."""

    async def run_episode(self, engines, sample):
        ids = np.frombuffer(sample["prompt"].encode(), np.uint8).astype(np.int32)
        n = len(ids)
        traj = Trajectory(
            model=next(iter(engines)),
            token_ids=ids,
            logprobs=np.zeros(n, np.float32),
            loss_mask=np.ones(n, np.uint8),
            versions=np.zeros(n, np.int32),
            reward=0.5,
        )
        return EpisodeResult([traj])


class Raises(RolloutWorkflow):
    """Fails every episode: its prompt group can never be rolled out."""

    async def run_episode(self, engines, sample):
        raise RuntimeError("workflow exploded")

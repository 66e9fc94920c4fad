"""The trainer of one policy: `python -m workers.trainer`, or under `torchrun` (FSDP2; gloo on CPU).

Settings from the env, the policy from `ASTRAFLOW_POLICY`; `astraflow trainer --model NAME` is the same.
"""

import os

from astraflow.launch.services import run_trainer
from astraflow.settings_load import load_settings

if __name__ == "__main__":
    s = load_settings()
    run_trainer(s, s.redis.url or "", os.environ.get("ASTRAFLOW_POLICY"))

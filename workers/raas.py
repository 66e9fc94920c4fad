"""A RaaS worker: `python -m workers.raas` (settings from the env; `astraflow raas` is the same)."""

from astraflow.launch.services import run_raas
from astraflow.settings_load import load_settings

if __name__ == "__main__":
    s = load_settings()
    run_raas(s, s.redis.url or "")

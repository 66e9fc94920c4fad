"""A dataflow replica: `python -m workers.dataflow` (settings from the env), as `astraflow dataflow`."""

from astraflow.launch.services import run_dataflow
from astraflow.settings_load import load_settings

if __name__ == "__main__":
    s = load_settings()
    run_dataflow(s, s.redis.url or "")

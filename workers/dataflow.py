"""A dataflow replica: `python -m workers.dataflow` (settings from the env), as `astraflow dataflow`."""

from astraflow.config import load_settings
from astraflow.launch.services import run_dataflow

if __name__ == "__main__":
    s = load_settings()
    run_dataflow(s, s.redis.url or "")

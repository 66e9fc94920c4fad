"""One demo RaaS worker of the bus demo: `python -m workers.demo raas NAME` (settings from the env)."""

import sys

from astraflow.launch.demo import worker_main

if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "raas":
        sys.exit("usage: python -m workers.demo raas NAME")
    worker_main(sys.argv[2])

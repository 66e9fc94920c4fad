"""`--smoke`: every bench script at a size that finishes in seconds, with its usual output.

A script passes its smoke size as defaults; `--smoke` puts them in place of its own, and any flag given
explicitly still wins. tests/bench/test_smoke.py runs each script so (completion and the shape of the
output, never its figures).
"""

from __future__ import annotations

import argparse


def parse(parser: argparse.ArgumentParser, args: list[str] | None = None, **smoke) -> argparse.Namespace:
    """Parse `args` (the command line) with `--smoke` added, whose defaults are `smoke`."""
    sizes = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in smoke.items())
    parser.add_argument(
        "--smoke", action="store_true", help=f"a size that finishes in seconds, for CI ({sizes})".strip()
    )
    if parser.parse_known_args(args)[0].smoke:
        parser.set_defaults(**smoke)
    return parser.parse_args(args)

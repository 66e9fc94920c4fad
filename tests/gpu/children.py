"""What a check's child process left behind when it failed: its own exception, in one line."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class ChildError(RuntimeError):
    """A child process of a check failed; the message is its own exception (`child_error`)."""


def free_port() -> int:
    from astraflow.redis_server import free_port as port

    return port()


def child_error(output: str) -> str:
    """The child's own exception in one line, `Type: message (file:line)` where it was raised, from its
    output: torchrun prefixes a rank's lines with `[rankN]:` and ends with its own ChildFailedError
    traceback, which is skipped. The output's last line when it holds no traceback."""
    lines = [re.sub(r"^\[(default)?rank\d+\]:\s?", "", line) for line in output.splitlines()]
    found = []
    for i, line in enumerate(lines):
        if line.startswith("Traceback (most recent call last)"):
            where, exc = "?", ""
            for later in lines[i + 1 :]:
                frame = re.match(r'\s+File "([^"]+)", line (\d+)', later)
                if frame:
                    path = Path(frame[1])
                    where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{frame[2]}"
                elif later.strip() and not later[0].isspace():
                    exc = later.strip()
                    break
            if "torch.distributed.elastic" not in exc and "ChildFailedError" not in exc:
                found.append(f"{exc} ({where})")
    if found:
        return found[-1][:400]
    return next((line for line in reversed(lines) if line.strip()), "no output")[:400]

"""structlog set-up: key-value events, a console renderer on a TTY, JSON lines otherwise (from the first
event: `astraflow` configures it before anything else runs), at the level `log.level` sets."""

from __future__ import annotations

import logging
import sys

import structlog


class _Stderr:
    """Whatever `sys.stderr` is at each write: a caller that swaps it (a test capturing a command's
    output) must not leave loggers writing to the closed one."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure(level: str = "info", *, worker: str | None = None, run: str | None = None) -> None:
    """Configure structlog for this process and bind `worker` and `run` into every event."""
    renderer = structlog.dev.ConsoleRenderer() if sys.stderr.isatty() else structlog.processors.JSONRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.PrintLoggerFactory(file=_Stderr()),
        cache_logger_on_first_use=False,  # `structlog.testing.capture_logs` must see every logger
    )
    structlog.contextvars.clear_contextvars()
    bound = {k: v for k, v in (("worker", worker), ("run", run)) if v is not None}
    structlog.contextvars.bind_contextvars(**bound)

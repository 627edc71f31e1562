"""structlog set-up: JSON lines for journald, a console renderer on a terminal.

Daemons (``edge-agent run``, ``hub-ingest run|watch``) log to stdout, which journald reads;
every other subcommand logs to stderr, so that what it prints on stdout (``--json``) parses.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog


def configure_logging(
    level: str = "info", *, json: bool | None = None, stream: TextIO | None = None
) -> None:
    """Route structlog (and stdlib logging, e.g. nats-py's) to `stream` (default stdout)."""
    stream = stream or sys.stdout
    use_json = not stream.isatty() if json is None else json
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(
        level=logging.WARNING, stream=stream, format="%(name)s %(message)s", force=True
    )

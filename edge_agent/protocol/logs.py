"""structlog set-up: JSON lines for journald, a console renderer on a terminal.

Daemons (``edge-agent run``, ``hub-ingest run|watch``) log to stdout, which journald reads;
every other subcommand logs to stderr, so that what it prints on stdout (``--json``) parses.
Records of stdlib loggers (nats-py, py4j, pyspark) go through the same processors
(`ProcessorFormatter` with a ``foreign_pre_chain``), so the journal gets one format.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog

# Libraries that narrate their normal work at INFO; their warnings still come through.
_CHATTY = ("py4j", "pyspark", "asyncio")
LOG_LEVELS = ("debug", "info", "warning", "error")  # what --log-level takes


def configure_logging(
    level: str = "info", *, json: bool | None = None, stream: TextIO | None = None
) -> None:
    """Route structlog and stdlib logging to `stream` (default stdout), in one format."""
    stream = stream or sys.stdout
    use_json = not stream.isatty() if json is None else json
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer()
    )
    shared: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[
            *shared,
            structlog.processors.StackInfoRenderer(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=False,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            renderer,
        ],
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level.upper())
    for name in _CHATTY:
        logging.getLogger(name).setLevel(max(logging.WARNING, root.level))

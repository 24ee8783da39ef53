"""Structured logging, configured once per process in its ``main`` (structlog's fast recipe).

JSON lines on stderr (``orjson``), or a console renderer when stderr is a terminal.
"""

from __future__ import annotations

import enum
import logging
import sys

import orjson
import structlog

__all__ = ["LOG_LEVELS", "LogLevel", "configure_logging"]


class LogLevel(enum.Enum):
    """Every command's ``--log-level``: the least severe records written."""

    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


LOG_LEVELS = tuple(level.value for level in LogLevel)  # the same, for a ``str`` option


def configure_logging(level: str = "info") -> None:
    renderer: structlog.types.Processor
    if sys.stderr.isatty():
        renderer = structlog.dev.ConsoleRenderer()
        factory: structlog.types.WrappedLogger = structlog.PrintLoggerFactory(sys.stderr)
    else:
        renderer = structlog.processors.JSONRenderer(serializer=orjson.dumps)
        factory = structlog.BytesLoggerFactory(sys.stderr.buffer)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=factory,
        cache_logger_on_first_use=True,
    )

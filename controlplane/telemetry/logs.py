"""structlog setup: JSON lines for pipelines, a console renderer for people.
Never log prompt text, API keys or tokens; log ids and counts.

Records of the standard ``logging`` module (libraries: alembic, SQLAlchemy,
asyncio) go through the same renderer, so with ``json`` every line on stderr
is one JSON object. The libraries' own INFO chatter (alembic's "Context impl
PostgresqlImpl.", its plugin set-up) is shown at ``debug`` only, and
SQLAlchemy's statement log never."""

from __future__ import annotations

import logging
import sys

import structlog

# Loggers of libraries whose INFO lines are for their own developers
# (SQLAlchemy's, at INFO and below, are every statement it sends: its own
# ``echo`` switch is the way to see them).
QUIET_BELOW_DEBUG = ("alembic",)
QUIET = ("sqlalchemy",)
_HANDLER_NAME = "burstgate"


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is at the time of the write, not
    the stream it was when logging was configured: a command run under a
    harness that swaps and then closes stderr (typer's CliRunner, pytest's
    capture) must not leave the process's loggers writing to a closed file."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()


STDERR = _CurrentStderr()


def configure(fmt: str = "console", level: str = "info") -> None:
    lvl = getattr(logging, level.upper())
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    _route_stdlib(renderer, lvl)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=STDERR),  # type: ignore[arg-type]
        cache_logger_on_first_use=True,
    )


def _route_stdlib(renderer: structlog.typing.Processor, lvl: int) -> None:
    """Render ``logging`` records with ``renderer`` on stderr. As
    ``logging.basicConfig`` did before, a root logger that already has
    handlers of someone else's (a test runner's) is left alone."""
    root = logging.getLogger()
    ours = [h for h in root.handlers if h.get_name() == _HANDLER_NAME]
    if root.handlers and not ours:
        return
    handler = ours[0] if ours else logging.StreamHandler(STDERR)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
            foreign_pre_chain=[
                structlog.stdlib.add_log_level,
                structlog.stdlib.add_logger_name,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
                structlog.processors.format_exc_info,
            ],
        )
    )
    if not ours:
        root.addHandler(handler)
    root.setLevel(lvl)
    for name in QUIET_BELOW_DEBUG:
        logging.getLogger(name).setLevel(lvl if lvl <= logging.DEBUG else logging.WARNING)
    for name in QUIET:
        logging.getLogger(name).setLevel(max(lvl, logging.WARNING))

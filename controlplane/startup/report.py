"""How a failed start is told: one line on stderr (``error: <cause>. <fix>``),
or one JSON record when ``BURSTGATE_LOG_FORMAT=json``, and the exit status
of its class (``startup.errors.Exit``).

Decision (docs/operating.md, "Start-up failures"): a failure burstgate does
not recognise exits 1 with the same one line (its type and message) and a
hint to re-run with ``BURSTGATE_LOG_LEVEL=debug``, which adds the traceback
(above the line on the console, in the record's ``exception`` field in
JSON). A failure while serving, after the "listening" line, is not a
start-up failure: it keeps its traceback.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import structlog
import typer
from pydantic import ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from controlplane.domain.errors import excerpt
from controlplane.settings import Settings
from controlplane.startup.errors import Exit, StartupError

DEBUG_HINT = "re-run with BURSTGATE_LOG_LEVEL=debug for the traceback"
log = structlog.get_logger("burstgate.startup")

# Settings whose value an error message must not quote (a password).
_SECRET_FIELDS = frozenset({"database_url"})


@dataclass
class Start:
    """One command's start: ``ready`` is set once it serves."""

    settings: Settings
    ready: bool = False


@contextmanager
def failures(settings: Settings) -> Iterator[Start]:
    """Configure logging, run the command's start inside, and turn any
    exception raised before ``Start.ready`` into its line and exit status."""
    from controlplane.telemetry import logs

    logs.configure(settings.log_format, settings.log_level)
    start = Start(settings)
    try:
        yield start
    except (typer.Exit, typer.Abort, typer.TyperException, SystemExit):
        raise
    except BaseException as exc:  # KeyboardInterrupt too: exit 130 in one line
        if start.ready:
            raise
        debug = settings.log_level == "debug"
        err = classify(exc, settings.database_url, debug=debug)
        report(err, log_format=settings.log_format, debug=debug, exc=exc)
        raise typer.Exit(int(err.code)) from None


def classify(exc: BaseException, database_url: str, *, debug: bool = False) -> StartupError:
    """The StartupError for any exception raised during a start."""
    from controlplane.startup.database import database_error
    from controlplane.store.replica_lock import HELP_TEXT, ReplicaLockHeld
    from controlplane.telemetry.tracing import TracingUnavailable

    if isinstance(exc, StartupError):
        return exc
    if isinstance(exc, KeyboardInterrupt):
        return StartupError(Exit.INTERRUPTED, "interrupted", "interrupted during start-up")
    if isinstance(exc, ReplicaLockHeld):
        return StartupError(
            Exit.REPLICA_LOCK, "replica_lock_held",
            f"another `burstgate serve` is running on database {exc.database} ({exc.holder})",
            HELP_TEXT.rstrip("."),
        )  # fmt: skip
    if isinstance(exc, TracingUnavailable):
        return StartupError(Exit.SETTINGS, "tracing_unavailable", str(exc),
                            "install it, or set BURSTGATE_TRACING=off")  # fmt: skip
    classified = database_error(exc, database_url)
    if classified is not None:
        return classified
    text = " ".join(str(exc).split())
    if len(text) > 300:
        text = text[:297] + "..."
    return StartupError(
        Exit.UNEXPECTED, "unexpected",
        f"start-up failed: {type(exc).__name__}" + (f": {text}" if text else ""),
        "a failure burstgate does not recognise: "
        + ("its traceback is logged with it" if debug else DEBUG_HINT),
    )  # fmt: skip


def report(
    err: StartupError, *, log_format: str, debug: bool, exc: BaseException | None = None
) -> None:
    """Write the failure to stderr: one line, or one JSON record (with the
    traceback in it at debug level)."""
    if log_format == "json":
        fields: dict[str, Any] = {
            "reason": err.reason,
            "exit_code": int(err.code),
            "error": err.cause,
        }
        if err.fix:
            fields["fix"] = err.fix
        if debug and exc is not None:
            fields["exc_info"] = exc
        log.error("start-up failed", **fields)
        return
    if debug and exc is not None:
        traceback.print_exception(exc, file=sys.stderr)
    sys.stderr.write(f"error: {err.line}\n")
    sys.stderr.flush()


class _LogPrefs(BaseSettings):
    """Only the log settings, read leniently: how to report settings that
    do not validate."""

    model_config = SettingsConfigDict(env_prefix="BURSTGATE_", env_file=".env", extra="ignore")
    log_format: str = "console"
    log_level: str = "info"


def load_settings(overrides: Mapping[str, Any], options: Mapping[str, str]) -> Settings:
    """Settings from the environment with the command line's ``overrides``
    (None = not given); invalid ones exit 2 with one line naming each bad
    option (``options``: field -> option name) or variable."""
    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        problems = [_describe(e, overrides, options) for e in exc.errors()]
        err = StartupError(
            Exit.SETTINGS, "invalid_settings", "; ".join(problems),
            ("correct it" if len(problems) == 1 else "correct them")
            + ' (docs/configuration.md lists every setting)',
        )  # fmt: skip
    fmt, level = _log_prefs()
    from controlplane.telemetry import logs

    logs.configure(fmt, level)
    report(err, log_format=fmt, debug=False)
    raise typer.Exit(int(err.code))


def _log_prefs() -> tuple[Literal["console", "json"], str]:
    try:
        prefs = _LogPrefs()
    except ValidationError:
        return "console", "info"
    fmt: Literal["console", "json"] = "json" if prefs.log_format == "json" else "console"
    level = prefs.log_level if prefs.log_level in ("debug", "info", "warning", "error") else "info"
    return fmt, level


def _describe(error: Any, overrides: Mapping[str, Any], options: Mapping[str, str]) -> str:
    loc = [part for part in error.get("loc", ()) if part != "__root__"]
    msg = str(error.get("msg", "invalid")).removeprefix("Value error, ")
    if not loc:
        return msg
    field = str(loc[0])
    if overrides.get(field) is not None and field in options:
        name = options[field]
    else:
        name = "BURSTGATE_" + "__".join(str(p).upper() for p in loc if isinstance(p, str))
        name += "".join(f"[{p}]" for p in loc if isinstance(p, int))
    value = error.get("input")
    shown = ""
    if field not in _SECRET_FIELDS and isinstance(value, str | int | float):
        shown = f" (got {excerpt(value)})"
    return f"{name}: {msg}{shown}"

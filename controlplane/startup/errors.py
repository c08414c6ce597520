"""Start-up failures of ``burstgate serve``, ``demo`` and ``migrate``: one
exit status per class (docs/operating.md, "Start-up failures"), and
:class:`StartupError`, which carries the one line an operator reads: what is
wrong and what to do about it."""

from __future__ import annotations

import enum


class Exit(enum.IntEnum):
    """Exit status of a failed start, one per class of failure. An
    orchestrator can tell a transient failure (4: retry later) from one that
    needs a person (the others)."""

    UNEXPECTED = 1  # a failure burstgate does not know (a bug, or a new case)
    SETTINGS = 2  # a bad option or BURSTGATE_* value (as every CLI usage error)
    REPLICA_LOCK = 3  # another `burstgate serve` holds this database
    DB_UNREACHABLE = 4  # the database does not answer (down, wrong host/port, timeout)
    DB_ACCESS = 5  # it answers but refuses us: login, missing database, permissions
    SCHEMA = 6  # no database yet, or its schema is older or newer than this burstgate
    LISTENER = 7  # the gRPC or metrics port cannot be bound
    TLS = 8  # a TLS file is missing, unreadable or invalid
    INTERRUPTED = 130  # SIGINT during start-up (128 + 2, the shell's convention)


class StartupError(Exception):
    """A start-up failure burstgate recognises. ``cause`` says what is
    wrong, ``fix`` what to do (each without a final full stop); ``reason``
    is a stable snake_case name for log pipelines."""

    def __init__(self, code: Exit, reason: str, cause: str, fix: str = "") -> None:
        self.code = code
        self.reason = reason
        self.cause = cause
        self.fix = fix
        super().__init__(self.line)

    @property
    def line(self) -> str:
        """The operator's one line (without the ``error:`` prefix): the
        cause, then the fix as a sentence of its own."""
        if not self.fix:
            return self.cause
        stop = "" if self.cause.endswith((".", "?", "!")) else "."
        return f"{self.cause}{stop} {self.fix[:1].upper()}{self.fix[1:]}"


DATABASE_OPTION = "--database-url / BURSTGATE_DATABASE_URL"
MIGRATE_FIX = "run `burstgate migrate` (same " + DATABASE_OPTION + ") to create or upgrade it"


GRPC_PORT_OPTION = "--port / BURSTGATE_PORT"
METRICS_PORT_OPTION = "--metrics-port / BURSTGATE_METRICS_PORT"
HOST_OPTION = "--host / BURSTGATE_HOST"

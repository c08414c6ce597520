"""The start-up failure classes that the integration tests cannot provoke on
this machine (PostgreSQL trusts local logins; the tests run as root): the
classifier on libpq's own message texts, and the listener messages by errno.
The real processes are in tests/integration/test_startup_errors.py."""

from __future__ import annotations

import errno

import psycopg
import pytest

from controlplane.startup.database import database_error
from controlplane.startup.errors import Exit, StartupError
from controlplane.startup.network import port_error
from controlplane.startup.report import classify

URL = "postgresql://bg:secret@db.internal:5432/burstgate"


def pg_error(text: str) -> StartupError:
    err = database_error(psycopg.OperationalError(text), URL)
    assert err is not None
    assert "secret" not in err.line and "bg:***@db.internal:5432/burstgate" in err.line
    return err


@pytest.mark.parametrize(
    ("text", "code", "reason", "says"),
    [
        ('connection failed: connection to server at "10.0.0.5", port 5432 failed: FATAL:  '
         'password authentication failed for user "bg"',
         Exit.DB_ACCESS, "database_login_failed", 'password authentication failed for user "bg"'),
        ('connection failed: connection to server at "10.0.0.5", port 5432 failed: FATAL:  '
         'no pg_hba.conf entry for host "10.0.0.9", user "bg", database "burstgate", no encryption',
         Exit.DB_ACCESS, "database_login_failed", "no pg_hba.conf entry"),
        ('connection failed: connection to server at "10.0.0.5", port 5432 failed: timeout expired',
         Exit.DB_UNREACHABLE, "database_unreachable", "BURSTGATE_DB_CONNECT_TIMEOUT_S"),
        ('connection failed: connection to server at "10.0.0.5", port 5432 failed: FATAL:  '
         "the database system is starting up",
         Exit.DB_UNREACHABLE, "database_unreachable", "the database system is starting up"),
        ('connection failed: connection to server at "10.0.0.5", port 5432 failed: server does '
         "not support SSL, but SSL was required",
         Exit.DB_ACCESS, "database_ssl_failed", "sslmode"),
    ],
)  # fmt: skip
def test_libpq_messages(text: str, code: Exit, reason: str, says: str) -> None:
    err = pg_error(text)
    assert (err.code, err.reason) == (code, reason)
    assert says in err.line and "BURSTGATE_DATABASE_URL" in err.line
    assert "\n" not in err.line


def test_only_the_first_line_of_a_libpq_message_is_kept() -> None:
    err = pg_error(
        'connection failed: connection to server at "10.0.0.5", port 5432 failed: Connection '
        "refused\n\tIs the server running on that host and accepting TCP/IP connections?"
    )
    assert err.cause == (
        "cannot connect to the database postgresql://bg:***@db.internal:5432/burstgate: "
        "Connection refused"
    )


@pytest.mark.parametrize(
    ("code", "says", "option"),
    [
        (errno.EADDRINUSE, "the metrics port 0.0.0.0:9464 is already in use",
         "--metrics-port / BURSTGATE_METRICS_PORT"),
        (errno.EACCES, "ports below 1024 need root or CAP_NET_BIND_SERVICE",
         "--metrics-port / BURSTGATE_METRICS_PORT"),
        (errno.EADDRNOTAVAIL, "0.0.0.0 is not an address of this machine",
         "--host / BURSTGATE_HOST"),
    ],
)  # fmt: skip
def test_listener_messages_by_errno(code: int, says: str, option: str) -> None:
    err = port_error("metrics", "0.0.0.0", 9464, OSError(code, "whatever"))
    assert err.code == Exit.LISTENER
    assert says in err.line and option in err.line


def test_unknown_errors_and_interrupts() -> None:
    err = classify(ValueError("a\nmultiline\n  message"), URL)
    assert (err.code, err.reason) == (Exit.UNEXPECTED, "unexpected")
    assert err.line == (
        "start-up failed: ValueError: a multiline message. A failure burstgate does not "
        "recognise: re-run with BURSTGATE_LOG_LEVEL=debug for the traceback"
    )
    assert int(classify(KeyboardInterrupt(), URL).code) == 130

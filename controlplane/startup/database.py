"""The database at start: is it there, can we log in, is its schema the one
this burstgate needs? Checked with one connection before anything is bound
or written, and every driver error turned into a :class:`StartupError`.

Decision (docs/operating.md, "Start-up failures"): ``serve`` never creates a
database. A SQLite file that does not exist (or whose directory does not)
is refused with "run ``burstgate migrate``"; ``migrate``, ``demo`` and
``serve --migrate`` create it, its directory included. A failed start
leaves the file system as it found it.

SQLAlchemy is used here for URLs, driver exceptions and the connection
that reads the schema's heads (``store.db.schema_heads``); no SQL is built
here. Imported lazily: ``burstgate --help`` does not load it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import quote

from controlplane.settings import Settings, sqlalchemy_url
from controlplane.startup.errors import DATABASE_OPTION, MIGRATE_FIX, Exit, StartupError


def shown(url: str) -> str:
    """The database URL as messages show it: as the operator wrote it, with
    the password hidden."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # an unparsable URL is reported by check_database
        return "the database URL"


def check_database(settings: Settings, *, create: bool) -> None:
    """Raise a StartupError unless the database can be used: reachable, and
    (``create`` False) at this burstgate's schema head, or (``create``
    True: the commands that migrate) creatable and not newer than the code."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    url = settings.database_url
    try:
        sa_url = make_url(sqlalchemy_url(url))
    except (ArgumentError, ValueError) as exc:
        raise StartupError(
            Exit.SETTINGS, "database_url_invalid",
            f"BURSTGATE_DATABASE_URL is not a valid URL ({exc})",
            "write it as sqlite:///path/to/file.db or postgresql://user:password@host:port/db",
        ) from None  # fmt: skip
    if sa_url.get_backend_name() == "sqlite":
        db = sa_url.database
        if not db or db == ":memory:":
            raise StartupError(
                Exit.SETTINGS, "database_in_memory",
                "an in-memory SQLite database (sqlite://) is empty at every start and private "
                "to one process: it cannot be migrated or served",
                f"give a file (sqlite:///var/burstgate.db) or PostgreSQL in {DATABASE_OPTION}",
            )  # fmt: skip
        # (a SQLite URI, file:..., is the operator's own business)
        if not db.startswith("file:") and not _check_sqlite_path(Path(db), create):
            return  # migrate creates it
    schema = _schema_state(settings)
    if schema is not None and (not create or schema.reason == "schema_ahead"):
        raise schema


def _check_sqlite_path(path: Path, create: bool) -> bool:
    """Whether the file exists; raise when it cannot be used (or, without
    ``create``, when it does not exist)."""
    path = path.absolute()
    if path.exists():
        if path.is_dir():
            raise _sqlite_access(path, f"{path} is a directory, not a SQLite database")
        if not os.access(path, os.R_OK | os.W_OK):
            raise _sqlite_access(path, f"SQLite database {path} is not readable and writable "
                                       "by this user")  # fmt: skip
        if not os.access(path.parent, os.W_OK | os.X_OK):
            raise _sqlite_access(
                path,
                f"the directory {path.parent} of the SQLite database is not writable by this "
                "user (SQLite writes its -wal and -shm files beside the database)",
            )
        return True
    if not create:
        missing_dir = "" if path.parent.is_dir() else f" (directory {path.parent} does not exist)"
        raise StartupError(
            Exit.SCHEMA, "database_missing",
            f"no SQLite database at {path}{missing_dir}; `serve` never creates one",
            f"create it with `burstgate migrate` (same {DATABASE_OPTION})",
        )  # fmt: skip
    ancestor = path.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise _sqlite_access(path, f"cannot create {path}: {ancestor} is not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise _sqlite_access(
            path, f"cannot create {path}: directory {ancestor} is not writable by this user"
        )
    return False


def _sqlite_access(path: Path, cause: str, reason: str = "database_not_writable") -> StartupError:
    return StartupError(
        Exit.DB_ACCESS, reason, cause,
        f"give this user (uid {os.getuid()}) write access there, or another path in "
        f"{DATABASE_OPTION}",
    )  # fmt: skip


def _schema_state(settings: Settings) -> StartupError | None:
    """Connect once; None when the schema is at head, else the StartupError
    that says how it differs (a connection failure is raised, classified)."""
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url

    from controlplane.store.db import code_heads, make_engine, schema_heads

    url = settings.database_url
    sa_url = make_url(sqlalchemy_url(url))
    db_file = sa_url.database or ""
    if sa_url.get_backend_name() == "sqlite" and not db_file.startswith("file:"):
        # Read-only, and without make_engine's WAL pragma: looking changes
        # nothing (an empty file stays empty).
        path = quote(str(Path(db_file).absolute()))
        engine = create_engine(f"sqlite:///file:{path}?mode=ro&uri=true")
    else:
        engine = make_engine(url, connect_timeout_s=settings.db_connect_timeout_s)
    try:
        with engine.connect() as conn:
            current = schema_heads(conn)
    except Exception as exc:
        classified = database_error(exc, url)
        if classified is None:
            raise
        raise classified from exc
    finally:
        engine.dispose()
    heads, known = code_heads(current)
    if set(current) == set(heads):
        return None
    db = shown(url)
    want = ", ".join(heads)
    if not current:
        return StartupError(
            Exit.SCHEMA, "schema_missing",
            f"database {db} has no burstgate schema (never migrated; this burstgate needs "
            f"revision {want})",
            MIGRATE_FIX,
        )  # fmt: skip
    have = ", ".join(current)
    if not known:
        return StartupError(
            Exit.SCHEMA, "schema_ahead",
            f"database {db} has schema revision {have}, which this burstgate (at {want}) does "
            "not know: a newer burstgate migrated it, or it belongs to another application",
            f"run the burstgate release that migrated it, or point {DATABASE_OPTION} at "
            "another database (`burstgate migrate` never downgrades)",
        )  # fmt: skip
    return StartupError(
        Exit.SCHEMA, "schema_behind",
        f"database {db} has schema revision {have}, older than this burstgate's {want}",
        MIGRATE_FIX,
    )  # fmt: skip


# libpq reports connection failures as text only (psycopg's ``sqlstate`` is
# None for them): these fragments of its messages, and of the server's FATAL
# ones it relays, tell the cases apart. A message none matches is still one
# line, classed as "unreachable".
_AUTH = (
    "password authentication failed", "no password supplied", "authentication failed",
    "pg_hba.conf", "password is required", "sasl authentication",
)  # fmt: skip
_ROLE = re.compile(r'role "[^"]*" does not exist')
_DATABASE = re.compile(r'database "[^"]*" does not exist')


def database_error(exc: BaseException, url: str) -> StartupError | None:
    """The StartupError for a driver (or SQLAlchemy) error raised while
    connecting or reading the schema; None when ``exc`` is not one."""
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    if isinstance(exc, NoSuchModuleError | ArgumentError):
        return StartupError(
            Exit.SETTINGS, "database_url_invalid",
            f"BURSTGATE_DATABASE_URL cannot be used: {exc}",
            "use sqlite:///path/to/file.db or postgresql://user:password@host:port/db",
        )  # fmt: skip
    orig: Any = getattr(exc, "orig", None) or exc  # SQLAlchemy wraps the driver's error
    module = type(orig).__module__
    if module.startswith("psycopg"):
        return _postgres_error(orig, url)
    if module == "sqlite3":
        return _sqlite_error(orig, url)
    return None


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _postgres_error(orig: Any, url: str) -> StartupError:
    import psycopg

    db = shown(url)
    state = getattr(orig, "sqlstate", None) or ""
    text = _one_line(str(orig))
    # 'connection failed: connection to server at "h", port 5432 failed: FATAL:  ...'
    # (libpq's second line, if any, is a hint such as "Is the server running
    # on that host ...?": left out of the one line)
    first = _one_line(str(orig).strip().splitlines()[0]) if str(orig).strip() else text
    detail = first.rsplit(" failed: ", 1)[-1].removeprefix("FATAL: ").strip()
    low = text.lower()
    fix_url = f"check {DATABASE_OPTION}"
    if isinstance(orig, psycopg.ProgrammingError) and not state:  # libpq refused the URL itself
        return StartupError(
            Exit.SETTINGS, "database_url_invalid",
            f"BURSTGATE_DATABASE_URL cannot be used: {detail}", fix_url,
        )  # fmt: skip
    if state == "3D000" or _DATABASE.search(low):
        name = _database_name(url)
        return StartupError(
            Exit.DB_ACCESS, "database_does_not_exist",
            f"cannot connect to the database {db}: {detail}",
            f"create it (`createdb {name}`) and run `burstgate migrate`, or correct the "
            f"database name in {DATABASE_OPTION}",
        )  # fmt: skip
    if state.startswith("28") or _ROLE.search(low) or any(p in low for p in _AUTH):
        return StartupError(
            Exit.DB_ACCESS, "database_login_failed",
            f"the database {db} refused the login: {detail}",
            f"check the user and password in {DATABASE_OPTION} (and the server's pg_hba.conf)",
        )  # fmt: skip
    if state == "42501" or "permission denied" in low:
        return StartupError(
            Exit.DB_ACCESS, "database_permission_denied",
            f"the database {db} refused access: {detail}",
            "grant this user CONNECT and the right to use burstgate's tables, or use the "
            f"role that ran `burstgate migrate` in {DATABASE_OPTION}",
        )  # fmt: skip
    if state == "42P01":  # undefined_table: a schema half there
        return StartupError(
            Exit.SCHEMA, "schema_missing", f"database {db} lacks burstgate's tables: {detail}",
            MIGRATE_FIX,
        )  # fmt: skip
    if "ssl" in low:
        return StartupError(
            Exit.DB_ACCESS, "database_ssl_failed", f"cannot connect to the database {db}: {detail}",
            f"check sslmode (and the certificates) in {DATABASE_OPTION}",
        )  # fmt: skip
    waited = " (the wait is BURSTGATE_DB_CONNECT_TIMEOUT_S)" if "timeout" in low else ""
    return StartupError(
        Exit.DB_UNREACHABLE, "database_unreachable",
        f"cannot connect to the database {db}: {detail}",
        f"check that PostgreSQL is running and reachable there, and {DATABASE_OPTION}{waited}",
    )  # fmt: skip


def _database_name(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(sqlalchemy_url(url)).database or "burstgate"


def _sqlite_error(orig: Any, url: str) -> StartupError:
    db = _database_name(url)
    text = _one_line(str(orig))
    low = text.lower()
    if "file is not a database" in low:
        return StartupError(
            Exit.DB_ACCESS, "database_not_sqlite", f"{db} is not a SQLite database ({text})",
            f"point {DATABASE_OPTION} at burstgate's database, or move that file away and run "
            "`burstgate migrate`",
        )  # fmt: skip
    if "locked" in low or "busy" in low:
        return StartupError(
            Exit.DB_UNREACHABLE, "database_locked", f"SQLite database {db} stays locked ({text})",
            "another process holds a write lock on it: let it finish, then start again",
        )  # fmt: skip
    if "no such table" in low:
        return StartupError(
            Exit.SCHEMA, "schema_missing",
            f"SQLite database {db} lacks burstgate's tables ({text})", MIGRATE_FIX,
        )  # fmt: skip
    return _sqlite_access(
        Path(db).absolute(), f"cannot use SQLite database {db}: {text}", "database_unusable"
    )

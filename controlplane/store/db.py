"""Engine creation and Alembic entry points."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import structlog
from alembic import command
from alembic.config import Config
from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.pool import QueuePool

from controlplane.settings import sqlalchemy_url

# How long a stopping server waits for connections still out on worker
# threads before it disposes of their engine anyway (a hung database).
DISPOSE_WAIT_S = 5.0

log = structlog.get_logger("burstgate.store")

REPO_ROOT = Path(__file__).resolve().parents[2]
# The Alembic scripts live in the repository's top-level migrations/;
# controlplane/_migrations is a symlink to it, so that a wheel carries them
# inside the package (a plain `pip install .` has no repository beside it).
MIGRATIONS_DIR = Path(__file__).resolve().parents[1] / "_migrations"
# Only in a checkout (developers run `alembic revision` with it); an installed
# package configures Alembic in code.
ALEMBIC_INI = REPO_ROOT / "alembic.ini"


# libpq keepalives for every PostgreSQL connection: a peer that vanished
# without a FIN (host lost, network cut) is noticed in ~11 s instead of the
# kernel's 2 h, so a thread blocked on it gets its error and returns.
PG_KEEPALIVES = {
    "keepalives": "1",
    "keepalives_idle": "5",
    "keepalives_interval": "2",
    "keepalives_count": "3",
}


def make_engine(url: str, *, connect_timeout_s: int = 5, statement_timeout_s: float = 0) -> Engine:
    """Create an engine. It creates nothing on disk (SQLite makes a missing
    database file at the first connection; only ``upgrade`` creates its
    directory), so a failed ``serve`` leaves nothing behind. PostgreSQL:
    libpq ``connect_timeout`` and keepalives, and a server-side
    ``statement_timeout`` when ``statement_timeout_s`` > 0; a parameter the
    URL sets itself is left as the URL says."""
    sa_url = make_url(sqlalchemy_url(url))
    if sa_url.get_backend_name() == "sqlite":
        engine = create_engine(sa_url)

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record):  # type: ignore[no-untyped-def]
            # WAL lets the CLI write while the server reads; foreign keys are
            # off by default in SQLite.
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=5000")
            cur.close()

        return engine
    params = {**PG_KEEPALIVES, "connect_timeout": str(connect_timeout_s)}
    if statement_timeout_s > 0:
        params["options"] = f"-c statement_timeout={round(statement_timeout_s * 1000)}"
    sa_url = sa_url.update_query_dict({**params, **dict(sa_url.query)})
    return create_engine(sa_url, pool_pre_ping=True)


def alembic_config(url: str) -> Config:
    cfg = Config(str(ALEMBIC_INI)) if ALEMBIC_INI.exists() else Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("path_separator", "os")
    # ConfigParser interpolation: a literal % in a password must be doubled.
    cfg.set_main_option("sqlalchemy.url", sqlalchemy_url(url).replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    """Migrate to ``revision``; a file SQLite database is created, with its
    directory, if it does not exist (``migrate`` and ``demo`` create it;
    ``serve`` never does)."""
    sa_url = make_url(sqlalchemy_url(url))
    db = sa_url.database
    if sa_url.get_backend_name() == "sqlite" and db and db != ":memory:" and db[:5] != "file:":
        Path(db).parent.mkdir(parents=True, exist_ok=True)
    command.upgrade(alembic_config(url), revision)


def schema_heads(conn: Connection) -> tuple[str, ...]:
    """The schema revision(s) the database is at (empty: never migrated)."""
    from alembic.runtime.migration import MigrationContext

    return tuple(MigrationContext.configure(conn).get_current_heads())


def code_heads(current: tuple[str, ...] = ()) -> tuple[tuple[str, ...], bool]:
    """(this code's head revisions, whether every revision in ``current`` is
    one this code knows: False when a newer burstgate migrated the database)."""
    from alembic.script import ScriptDirectory
    from alembic.util import CommandError

    scripts = ScriptDirectory.from_config(alembic_config("sqlite://"))
    heads = tuple(scripts.get_heads())
    try:
        for rev in current:
            if scripts.get_revision(rev) is None:
                return heads, False
    except CommandError:  # "Can't locate revision identified by ..."
        return heads, False
    return heads, True


def downgrade(url: str, revision: str) -> None:
    command.downgrade(alembic_config(url), revision)


def checked_out(engine: Engine) -> int:
    """Connections of ``engine``'s pool in use now (0 for a pool that keeps
    none, which closes each connection as it comes back)."""
    pool = engine.pool
    return pool.checkedout() if isinstance(pool, QueuePool) else 0


async def dispose_when_idle(engine: Engine, what: str, wait_s: float = DISPOSE_WAIT_S) -> None:
    """Dispose of ``engine`` (``what`` names it in the log) once the
    connections still checked out have come back, waiting at most ``wait_s``
    (past it: disposed anyway, and a warning says how many were still out).

    Why wait: a call whose caller gave up (a cancelled task, a bounded wait
    that timed out) runs on in its thread. ``dispose`` closes only the
    connections in the pool and swaps in a new one; a connection handed
    back later goes into the old pool, which nobody closes, and is
    garbage-collected still open (psycopg's ResourceWarning, a server
    backend held until then)."""
    deadline = time.monotonic() + wait_s
    while (out := checked_out(engine)) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    engine.dispose()
    if out:
        log.warning("database engine disposed with connections still in use",
                    engine=what, connections=out)  # fmt: skip

"""Engine creation and Alembic entry points."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url

from controlplane.settings import sqlalchemy_url

REPO_ROOT = Path(__file__).resolve().parents[2]
MIGRATIONS_DIR = REPO_ROOT / "migrations"


def make_engine(url: str) -> Engine:
    """Create an engine; for a file SQLite URL, create the parent directory."""
    sa_url = make_url(sqlalchemy_url(url))
    if sa_url.get_backend_name() == "sqlite":
        db = sa_url.database
        if db and db != ":memory:":
            Path(db).parent.mkdir(parents=True, exist_ok=True)
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
    return create_engine(sa_url, pool_pre_ping=True)


def alembic_config(url: str) -> Config:
    cfg = Config(str(REPO_ROOT / "alembic.ini"))
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    # ConfigParser interpolation: a literal % in a password must be doubled.
    cfg.set_main_option("sqlalchemy.url", sqlalchemy_url(url).replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    if url.startswith("sqlite:///"):
        make_engine(url).dispose()  # creates the parent directory
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    command.downgrade(alembic_config(url), revision)

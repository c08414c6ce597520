"""A throwaway PostgreSQL database for a benchmark (the local server these
machines run, or ``$BURSTGATE_TEST_PG_DSN``), dropped when it ends."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from sqlalchemy.engine import make_url

ADMIN_DSN = os.environ.get("BURSTGATE_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")


@contextmanager
def database(admin_dsn: str = ADMIN_DSN) -> Iterator[str]:
    """The URL of a new, empty database; dropped (connections and all) after."""
    name = f"burstgate_bench_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield make_url(admin_dsn).set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

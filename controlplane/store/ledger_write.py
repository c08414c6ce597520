"""How a batch of ledger rows is written, and the writer's engine.

Ledger rows go to PostgreSQL with one binary ``COPY`` per batch: the
records are ``LedgerRecord`` named tuples, written as they are (no per-row
object in between), each column dumped by the binary dumper of its
PostgreSQL type, fixed once per COPY with ``set_types`` (``PG_TYPES``). The
``numeric`` columns go through a cache of their binary form (see
``_numeric_binary_dumper``): psycopg's own binary Decimal dumper costs ~2
µs a value, and these columns take few distinct values. On SQLite, one
``executemany``. ``LedgerStore.insert`` (store/ledger.py) calls these on a
raw driver connection.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from sqlalchemy import BigInteger, Engine, Numeric, String, event
from sqlalchemy.engine import make_url

from controlplane.domain.ledger_records import COLUMNS, Key, LedgerRecord
from controlplane.settings import sqlalchemy_url
from controlplane.store.db import make_engine
from controlplane.store.models import LedgerRecordRow

_COLS = ", ".join(COLUMNS)
_COPY = f"COPY ledger_records ({_COLS}) FROM STDIN (FORMAT BINARY)"
_COPY_STAGE = f"COPY ledger_stage ({_COLS}) FROM STDIN (FORMAT BINARY)"
_STAGE = (
    "CREATE TEMP TABLE IF NOT EXISTS ledger_stage "
    "(LIKE ledger_records INCLUDING DEFAULTS) ON COMMIT DELETE ROWS"
)
_MERGE_STAGE = (
    f"INSERT INTO ledger_records ({_COLS}) SELECT {_COLS} FROM ledger_stage "
    "ON CONFLICT (tenant_id, request_id) DO NOTHING RETURNING tenant_id, request_id"
)
_SQLITE_INSERT = f"INSERT INTO ledger_records ({_COLS}) VALUES ({', '.join('?' * len(COLUMNS))})"
_SQLITE_INSERT_IGNORE = _SQLITE_INSERT + " ON CONFLICT (tenant_id, request_id) DO NOTHING"
_DEC = tuple(i for i, c in enumerate(COLUMNS) if c in {
    "kv_cache_miss_rate", "pricing_multiplier", "lane_multiplier"})  # fmt: skip


def _pg_type(name: str) -> str:
    t = LedgerRecordRow.__table__.c[name].type
    if isinstance(t, BigInteger):
        return "int8"
    if isinstance(t, Numeric):
        return "numeric"
    if isinstance(t, String):
        return "varchar"
    raise TypeError(f"ledger_records.{name}: no binary COPY type for {t!r}")


# The PostgreSQL type of each column, in COLUMNS order: a binary COPY
# carries no types, so every value is dumped as the type of its column
# (the server checks lengths and applies the numeric typmods on receive,
# exactly as it does for text).
PG_TYPES: tuple[str, ...] = tuple(_pg_type(name) for name in COLUMNS)
_NUMERIC_CACHE_MAX = 16_384
_MERGE_ATTEMPTS = 3


@functools.cache
def _numeric_binary_dumper() -> type[Any]:
    """psycopg's binary ``numeric`` dumper behind a cache keyed by the
    value's text. The bytes are exactly psycopg's own encoding of that
    value; only the cost changes (~0.2 µs a value instead of ~2: ``str`` of a
    Decimal is cheap, its hash and its digit tuple are not). Registered per
    COPY cursor and only by oid, so nothing else on the connection uses it."""
    from psycopg import pq
    from psycopg.adapt import Dumper
    from psycopg.types.numeric import NumericBinaryDumper

    cache: dict[str, bytes] = {}

    class CachedNumericBinaryDumper(Dumper):
        format = pq.Format.BINARY

        oid = NumericBinaryDumper.oid

        def __init__(self, cls: type, context: Any = None) -> None:
            super().__init__(cls, context)
            self._dump = NumericBinaryDumper(cls, context).dump

        def dump(self, obj: Any) -> bytes:
            key = str(obj)
            out = cache.get(key)
            if out is None:
                dumped = self._dump(obj)
                assert dumped is not None
                out = bytes(dumped)
                if len(cache) >= _NUMERIC_CACHE_MAX:
                    cache.clear()
                cache[key] = out
            return out

    return CachedNumericBinaryDumper


def _copy_rows(cur: Any, sql: str, records: Sequence[LedgerRecord]) -> None:
    """One binary COPY of ``records`` (named tuples, written as they are)."""
    cur.adapters.register_dumper(None, _numeric_binary_dumper())
    with cur.copy(sql) as copy:
        copy.set_types(PG_TYPES)
        write_row = copy.write_row
        for r in records:
            write_row(r)


# libpq settings of the writer's own connections: fail fast instead of
# hanging on a dead network (the writer falls back to the spool), and
# make every commit durable whatever the server's default.
PG_WRITER_PARAMS = {
    "connect_timeout": "5",
    "keepalives": "1",
    "keepalives_idle": "5",
    "keepalives_interval": "2",
    "keepalives_count": "2",
    "tcp_user_timeout": "10000",
    "options": "-c synchronous_commit=on",
}


def ledger_engine(url: str) -> Engine:
    """An engine for metering: PostgreSQL with the writer's libpq settings;
    SQLite with synchronous=FULL (a commit survives a power loss in WAL mode)."""
    sa_url = make_url(sqlalchemy_url(url))
    if sa_url.get_backend_name() == "postgresql":
        query = {**PG_WRITER_PARAMS, **dict(sa_url.query)}
        engine = make_engine(sa_url.update_query_dict(query).render_as_string(hide_password=False))
        return engine
    engine = make_engine(url)

    @event.listens_for(engine, "connect")
    def _full_sync(dbapi_conn, _record):  # type: ignore[no-untyped-def]
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA synchronous=FULL")
        cur.close()

    return engine


def _sqlite_row(r: LedgerRecord) -> tuple[Any, ...]:
    values = list(r)
    for i in _DEC:
        values[i] = str(values[i])
    return tuple(values)


def pg_insert(conn: Any, records: Sequence[LedgerRecord]) -> set[Key]:
    """COPY straight into the table; on a key conflict, COPY into the
    staging table and merge with ``ON CONFLICT DO NOTHING``. Two
    transactions inserting the same keys in different orders (batches
    written at once; a replay beside a write that timed out) can
    deadlock: PostgreSQL aborts one, which is redone by the merge (the
    other's rows then count as already recorded)."""
    import psycopg

    try:
        with conn.cursor() as cur:
            _copy_rows(cur, _COPY, records)
        conn.commit()
        return set()
    except (psycopg.errors.UniqueViolation, psycopg.errors.DeadlockDetected):
        conn.rollback()
    for attempt in range(_MERGE_ATTEMPTS):
        try:
            with conn.cursor() as cur:
                cur.execute(_STAGE)
                _copy_rows(cur, _COPY_STAGE, records)
                cur.execute(_MERGE_STAGE)
                inserted = {(t, q) for t, q in cur.fetchall()}
            conn.commit()
            return {r.key for r in records} - inserted
        except psycopg.errors.DeadlockDetected:
            conn.rollback()
            if attempt == _MERGE_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")

def sqlite_insert(conn: Any, records: Sequence[LedgerRecord]) -> set[Key]:
    import sqlite3

    rows = [_sqlite_row(r) for r in records]
    try:
        conn.executemany(_SQLITE_INSERT, rows)
        conn.commit()
        return set()
    except sqlite3.IntegrityError:
        conn.rollback()
    conflicts: set[Key] = set()
    cur = conn.cursor()
    for r, row in zip(records, rows, strict=True):
        cur.execute(_SQLITE_INSERT_IGNORE, row)
        if cur.rowcount == 0:
            conflicts.add(r.key)
    conn.commit()
    return conflicts

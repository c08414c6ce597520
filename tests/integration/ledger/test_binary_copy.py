"""The binary COPY writes exactly what the text COPY wrote: every column,
every row, money exact, on real PostgreSQL, through the fast path and the
conflict path (staging table + ``INSERT ... ON CONFLICT DO NOTHING``).

The reference is the writer's previous code, kept here verbatim: a text
``COPY ... FROM STDIN`` with ``write_row`` (psycopg picks the dumper per
value), into a second table made ``LIKE ledger_records``. Both tables are
read back with every column cast to text, so a different numeric scale, a
lost digit or a changed character would show."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.domain.ledger_records import COLUMNS, Key, LedgerRecord
from controlplane.store import ledger_write
from controlplane.store.db import upgrade
from controlplane.store.ledger import LedgerStore
from controlplane.store.ledger_write import PG_TYPES, ledger_engine

_COLS = ", ".join(COLUMNS)
I64 = 2**63 - 1


# --------------------------------------------------------- the text reference


def _text_insert(
    conn: psycopg.Connection[Any], table: str, records: Sequence[LedgerRecord]
) -> set[Key]:
    """The previous ``pg_insert`` (text COPY), on ``table``."""
    try:
        with conn.cursor() as cur, cur.copy(f"COPY {table} ({_COLS}) FROM STDIN") as copy:
            for r in records:
                copy.write_row(r)
        conn.commit()
        return set()
    except psycopg.errors.UniqueViolation:
        conn.rollback()
    with conn.cursor() as cur:
        cur.execute(
            f"CREATE TEMP TABLE IF NOT EXISTS {table}_stage "
            f"(LIKE {table} INCLUDING DEFAULTS) ON COMMIT DELETE ROWS"
        )
        with cur.copy(f"COPY {table}_stage ({_COLS}) FROM STDIN") as copy:
            for r in records:
                copy.write_row(r)
        cur.execute(
            f"INSERT INTO {table} ({_COLS}) SELECT {_COLS} FROM {table}_stage "
            "ON CONFLICT (tenant_id, request_id) DO NOTHING RETURNING tenant_id, request_id"
        )
        inserted = {(t, q) for t, q in cur.fetchall()}
    conn.commit()
    return {r.key for r in records} - inserted


class Both:
    """``ledger_records`` written by ``LedgerStore`` (binary COPY) and
    ``ledger_ref`` written by the text reference, side by side."""

    def __init__(self, url: str) -> None:
        self.engine = ledger_engine(url)
        self.store = LedgerStore(self.engine)
        self.conn = psycopg.connect(url.replace("postgresql+psycopg", "postgresql"))
        with self.conn.cursor() as cur:
            cur.execute("CREATE TABLE ledger_ref (LIKE ledger_records INCLUDING ALL)")
        self.conn.commit()

    def insert(self, records: Sequence[LedgerRecord]) -> set[Key]:
        ours = self.store.insert(records)
        ref = _text_insert(self.conn, "ledger_ref", records)
        assert ours == ref
        return ours

    def rows(self, table: str) -> list[tuple[str | None, ...]]:
        cols = ", ".join(f"{c}::text" for c in COLUMNS)
        with self.conn.cursor() as cur:
            cur.execute(f"SELECT {cols} FROM {table} ORDER BY tenant_id, request_id")
            out = [tuple(r) for r in cur.fetchall()]
        self.conn.commit()
        return out

    def assert_same(self) -> list[tuple[str | None, ...]]:
        ours, ref = self.rows("ledger_records"), self.rows("ledger_ref")
        assert ours == ref
        return ours

    def clear(self) -> None:
        with self.conn.cursor() as cur:
            cur.execute("TRUNCATE ledger_records, ledger_ref")
        self.conn.commit()

    def close(self) -> None:
        self.conn.close()
        self.engine.dispose()


@pytest.fixture
def both(pg_url: str) -> Iterator[Both]:
    upgrade(pg_url)
    b = Both(pg_url)
    yield b
    b.close()


# ------------------------------------------------------------------ records


def rec(request_id: str, tenant_id: str = "acme", **kw: Any) -> LedgerRecord:
    base = LedgerRecord(
        tenant_id=tenant_id, request_id=request_id, reservation_id=7, lane="standard",
        model="llama-3-70b", pool="a100", arrival_ns=1_700_000_000_000_000_001,
        queue_start_ns=1_700_000_000_000_000_001, exec_start_ns=1_700_000_000_100_000_000,
        end_ns=1_700_000_001_000_000_000, settled_ns=1_700_000_001_000_000_123,
        prompt_tokens=900, cached_tokens=300, output_tokens=250, reserved_tokens=1400,
        kv_cache_miss_rate=Decimal("0.250000"), miss_rate_source="request",
        pricing_multiplier=Decimal("1.200000"), pricing_window=1_700_000_100,
        lane_multiplier=Decimal("1.500000"), currency="USD",
        user_charge_nanos=4_200_000_001, actual_cost_nanos=3_100_000_007, price_id=3,
    )  # fmt: skip
    return base._replace(**kw)


EDGES: list[LedgerRecord] = [
    rec("plain"),
    # Characters the text format escapes, and the 128/32/256/128/8/3 limits.
    rec("tab\there", lane="a\\b", model="new\nline", pool='comma,"quote"'),
    rec("\\N", tenant_id="ténant-ü", model="模型-🚀", pool="ß" * 128),
    rec("r" * 128, tenant_id="t" * 128, lane="l" * 32, model="m" * 256, currency="€€€"),
    rec("empty", lane="", model="", pool="", miss_rate_source="", currency=""),
    # Integers at the bigint bounds (types allow them; exactness is the point).
    rec(
        "i64",
        reservation_id=I64,
        arrival_ns=I64,
        settled_ns=I64,
        user_charge_nanos=I64,
        actual_cost_nanos=I64,
        price_id=I64,
        pricing_window=I64,
    ),
    rec(
        "i64-min",
        reservation_id=-I64 - 1,
        user_charge_nanos=-I64 - 1,
        prompt_tokens=0,
        cached_tokens=0,
        output_tokens=0,
        reserved_tokens=0,
        price_id=0,
    ),
    # Decimals: other scales than the columns' 6 (the server rounds both
    # formats the same way), zeros, bounds, exponents, negatives.
    rec(
        "d-scale",
        pricing_multiplier=Decimal("1.5"),
        lane_multiplier=Decimal("2"),
        kv_cache_miss_rate=Decimal("0.1"),
    ),
    rec(
        "d-round",
        pricing_multiplier=Decimal("1.0000005"),
        lane_multiplier=Decimal("1.2345674999"),
        kv_cache_miss_rate=Decimal("0.1234565"),
    ),
    rec(
        "d-zero",
        pricing_multiplier=Decimal("0"),
        lane_multiplier=Decimal("0.000000"),
        kv_cache_miss_rate=Decimal("0E-9"),
        miss_rate_source="none",
    ),
    rec(
        "d-max",
        pricing_multiplier=Decimal("999999.999999"),
        lane_multiplier=Decimal("1E+5"),
        kv_cache_miss_rate=Decimal("1.000000"),
    ),
    rec(
        "d-tiny",
        pricing_multiplier=Decimal("0.000001"),
        lane_multiplier=Decimal("1.2E-5"),
        kv_cache_miss_rate=Decimal("0.999999"),
    ),
    rec(
        "d-neg",
        pricing_multiplier=Decimal("-1.250000"),
        lane_multiplier=Decimal("-0.000001"),
        kv_cache_miss_rate=Decimal("-0"),
    ),
    rec(
        "d-big-digits",
        pricing_multiplier=Decimal("123456.654321"),
        lane_multiplier=Decimal("10000.0001"),
        kv_cache_miss_rate=Decimal("0.000100"),
    ),
]


def _canonical(r: LedgerRecord) -> bool:
    """A record whose Decimals are what the columns keep (6 places, in range)."""
    return all(
        getattr(r, c).as_tuple().exponent == -6
        for c in ("kv_cache_miss_rate", "pricing_multiplier", "lane_multiplier")
    )


# -------------------------------------------------------------------- tests


def test_pg_types_are_the_table_columns(both: Both) -> None:
    with both.conn.cursor() as cur:
        cur.execute(
            "SELECT attname, format_type(atttypid, NULL) FROM pg_attribute "
            "WHERE attrelid = 'ledger_records'::regclass AND attnum > 0 AND NOT attisdropped"
        )
        table: dict[str, str] = dict(cur.fetchall())
    names = {"int8": "bigint", "numeric": "numeric", "varchar": "character varying"}
    assert [table[c] for c in COLUMNS] == [names[t] for t in PG_TYPES]
    assert set(table) == set(COLUMNS)


def test_edge_values_are_written_exactly_as_text_copy_wrote_them(both: Both) -> None:
    assert both.insert(EDGES) == set()
    rows = both.assert_same()
    assert len(rows) == len(EDGES)
    # And read back through the store, the canonical records are the records.
    stored = both.store.fetch_many(r.key for r in EDGES)
    for r in EDGES:
        if _canonical(r):
            assert stored[r.key] == r
    assert stored[("acme", "d-round")].pricing_multiplier == Decimal("1.000001")
    assert stored[("acme", "d-round")].kv_cache_miss_rate == Decimal("0.123457")


def test_conflict_path_keeps_the_originals_and_reports_the_same_keys(both: Both) -> None:
    first = [rec(f"req-{i}", user_charge_nanos=1_000 + i) for i in range(20)] + EDGES[:5]
    assert both.insert(first) == set()
    # Half of them again with other figures, interleaved with new ones, and
    # one key twice in the batch (the staging merge keeps its first row).
    again = []
    for i in range(10):
        again.append(rec(f"req-{i * 2}", user_charge_nanos=9_999, pricing_multiplier=Decimal("9")))
        again.append(rec(f"new-{i}", user_charge_nanos=5_000 + i, lane_multiplier=Decimal("1.1")))
    again += [EDGES[1]._replace(actual_cost_nanos=1), rec("twice", price_id=1)]
    again.append(rec("twice", price_id=2))
    conflicts = both.insert(again)
    assert conflicts == {("acme", f"req-{i * 2}") for i in range(10)} | {EDGES[1].key}
    rows = both.assert_same()
    assert len(rows) == len(first) + 10 + 1
    stored = both.store.fetch_many([*(r.key for r in first), *(r.key for r in again)])
    for r in first:
        if _canonical(r):
            assert stored[r.key] == r  # the original stands, every column
    for r in again:
        if r.request_id.startswith("new-"):
            assert stored[r.key] == r
    assert stored[("acme", "twice")].price_id == 1


def test_numeric_cache_stays_exact_across_many_values_and_clears(
    both: Both, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ledger_write, "_NUMERIC_CACHE_MAX", 16)  # clears again and again
    records = [
        rec(
            f"ppm-{ppm}",
            kv_cache_miss_rate=Decimal(ppm).scaleb(-6),
            pricing_multiplier=Decimal(1_000_000 + ppm * 7).scaleb(-6),
            lane_multiplier=Decimal(ppm // 997 % 1000).scaleb(-3),
            user_charge_nanos=ppm * 1_000_003,
        )
        for ppm in range(0, 1_000_001, 997)
    ]
    assert both.insert(records) == set()
    both.assert_same()
    stored = both.store.fetch_many(r.key for r in records)
    for r in records:
        assert stored[r.key] == r


# (Bounded so that the server's rounding to 6 places cannot overflow numeric(12, 6).)
decimals = st.integers(0, 9).flatmap(
    lambda places: st.decimals(
        min_value=Decimal("-999999"), max_value=Decimal("999999"), places=places
    )
)
rates = st.integers(0, 8).flatmap(
    lambda places: st.decimals(min_value=0, max_value=1, places=places)
)
text_st = st.text(
    st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00"), max_size=8
)
random_records = st.lists(
    st.builds(
        lambda key, lane, n, d1, d2, rate, cur: rec(
            key[1],
            tenant_id=key[0],
            lane=lane,
            reservation_id=n,
            settled_ns=n,
            user_charge_nanos=n // 3,
            pricing_multiplier=d1,
            lane_multiplier=d2,
            kv_cache_miss_rate=rate,
            currency=cur,
        ),
        st.tuples(text_st, text_st),
        text_st,
        st.integers(-(2**63), I64),
        decimals,
        decimals,
        rates,
        st.text(
            st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00"), max_size=3
        ),
    ),
    max_size=30,
    unique_by=lambda r: r.key,
)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(first=random_records, second=random_records)
def test_random_batches_write_what_text_copy_wrote(
    both: Both, first: list[LedgerRecord], second: list[LedgerRecord]
) -> None:
    both.clear()
    both.insert(first)
    both.insert(second + first[: len(first) // 2])  # new keys and conflicts
    both.assert_same()


def test_too_long_value_fails_the_batch_and_writes_nothing(both: Both) -> None:
    bad = [rec("ok-1"), rec("x", lane="l" * 33), rec("ok-2")]
    with pytest.raises(psycopg.errors.StringDataRightTruncation):
        both.store.insert(bad)
    assert both.rows("ledger_records") == []
    assert both.store.insert([rec("ok-1")]) == set()  # the store still writes


def test_sqlite_executemany_path_unchanged(sqlite_url: str) -> None:
    upgrade(sqlite_url)
    engine = ledger_engine(sqlite_url)
    try:
        store = LedgerStore(engine)
        canonical = [r for r in EDGES if _canonical(r)]
        assert store.insert(canonical) == set()
        again = [canonical[0]._replace(user_charge_nanos=1), rec("fresh")]
        assert store.insert(again) == {canonical[0].key}
        stored = store.fetch_many([*(r.key for r in canonical), ("acme", "fresh")])
        for r in canonical:
            assert stored[r.key] == r
        assert stored[("acme", "fresh")] == rec("fresh")
    finally:
        engine.dispose()

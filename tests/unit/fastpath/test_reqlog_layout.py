"""The compiled request table's storage: narrow columns, the overflow block, generations,
an index that follows the live count, memory that stops growing once full.

Every answer is checked against the reference (``_reqlog_py``), which keeps rows as
tuples of unbounded ints: a value the compiled build truncated would show as a different
row.  The compiled-only counters (``wide_rows``, ``footprint()["bytes"]``) check that the
storage is the one intended.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from controlplane.service import records as R
from fastpath import _reqlog_py

from .conftest import compiled
from .test_reqlog_properties import EDGES, NARROW

T0 = 1_700_000_000 * 10**9
F64_ONE = R.float_bits(1.0)


@pytest.fixture
def c() -> Any:
    return compiled("_reqlog_c")


def admission(decided: int = T0, **columns: int) -> tuple[int, ...]:
    """An admitted row as the service makes it, with ``columns`` (records' names) set."""
    row = [0] * R.FIELDS
    row[R.DECIDED_NS] = decided
    row[R.ARRIVED_NS] = decided - 1_000
    row[R.RID] = T0 // 1000
    row[R.RESERVED], row[R.GRANTED], row[R.BUCKET], row[R.HOUR], row[R.DAY] = 300, 200, 5, -1, -1
    row[R.LANE], row[R.POOL], row[R.MODEL], row[R.MULTIPLIER] = 1, 2, 3, F64_ONE
    row[R.ACTUAL], row[R.FRESHNESS] = -1, 1
    for name, value in columns.items():
        row[getattr(R, name)] = value
    return tuple(row)


def tables(c: Any, ttl: int = 10**12) -> tuple[Any, Any]:
    return _reqlog_py.RequestTable(ttl, ttl, ttl), c.RequestTable(ttl, ttl, ttl)


def test_the_narrow_ranges_are_the_compiled_builds(c: Any) -> None:
    assert c._NARROW == NARROW


def test_values_at_and_past_each_range_read_back_exactly(c: Any) -> None:
    py, table = tables(c)
    wide = 0
    for i, (col, value) in enumerate(EDGES):
        row = list(admission())
        row[col] = row[R.DECIDED_NS] - value if col == R.ARRIVED_NS else value
        lo, hi = NARROW.get(col, (-(2**63), 2**63 - 1))
        wide += not lo <= value <= hi
        for t in (py, table):
            t.add(0, "t", f"r{i}", tuple(row))
        assert table.get(0, "t", f"r{i}") == py.get(0, "t", f"r{i}") == tuple(row), (col, value)
    assert 0 < wide == table.wide_rows < len(EDGES)
    ids = [f"r{i}" for i in range(len(EDGES))]
    tkeys = np.zeros(len(ids), dtype=np.int64)
    assert table.replay_many(tkeys, ["t"] * len(ids), ids, T0) == py.replay_many(
        tkeys, ["t"] * len(ids), ids, T0
    )
    # Settling every one, with usage at the 32-bit edges: the same settled rows.
    for i in range(len(ids)):
        actual, refunded = [(2**31 - 1, -(2**31)), (2**31, 0), (5, -(2**31) - 1)][i % 3]
        got = table.settle(0, "t", ids[i], actual, refunded, T0 + 1)
        assert got == py.settle(0, "t", ids[i], actual, refunded, T0 + 1)
    assert table.wide_rows > wide  # settlements too wide for the row's columns moved it
    assert table.expire(T0 + 10**12) == py.expire(T0 + 10**12) == []
    assert len(table) == table.wide_rows == 0  # every overflow row went with its row


def test_a_batch_of_wide_and_narrow_rows_is_stored_in_order(c: Any) -> None:
    py, table = tables(c)
    rows = np.array([admission(), admission(RESERVED=2**31), admission(LANE=-1)] * 2)
    ids = ["a", "b", "c", "a", "d", "b"]  # a and b stored twice: the later row wins
    rows[3, R.RESERVED] = 2**31
    rows[5, R.RESERVED], rows[5, R.LANE] = 7, 1
    args = (np.zeros(6, dtype=np.int64), ["t"] * 6, ids, rows)
    py.add_batch(*args)
    table.add_batch(*args)
    for r in "abcd":
        assert table.get(0, "t", r) == py.get(0, "t", r)
    assert table.wide_rows == 3  # a (replaced by a wide one), c and d; b is narrow again
    assert table.get(0, "t", "b")[R.RESERVED] == 7


def test_the_multiplier_dictionary_holds_65535_values_then_rows_go_wide(c: Any) -> None:
    py, table = tables(c)
    n = 65_536
    rows = np.array([admission()] * n)
    rows[:, R.MULTIPLIER] = np.arange(n, dtype=np.int64) * 977 - 2**40
    args = (np.zeros(n, dtype=np.int64), ["t"] * n, [f"r{i}" for i in range(n)], rows)
    py.add_batch(*args)
    table.add_batch(*args)
    assert table.wide_rows == 1
    assert table.get(0, "t", f"r{n - 1}") == py.get(0, "t", f"r{n - 1}")
    assert table.get(0, "t", "r12345") == py.get(0, "t", "r12345")
    # A value the dictionary already holds still fits.
    table.add(0, "t", "again", tuple(rows[7]))
    assert table.wide_rows == 1
    assert table.get(0, "t", "again") == tuple(int(x) for x in rows[7])


@pytest.mark.parametrize("wide_tkey", [2**32 + 1, -(2**32) + 1, 2**63 - 1, -(2**63)])
def test_a_tkey_past_32_bits_is_its_own_key(c: Any, wide_tkey: int) -> None:
    # Every wide tkey here has the low 32 bits of 1 or of -1 (or of 0 and -1 at the ends).
    py, table = tables(c)
    narrow = [1, -1, 0]
    for k, tkey in enumerate([*narrow, wide_tkey]):
        for t in (py, table):
            t.add(tkey, "t", "r", admission(RESERVED=k))
    for tkey in [*narrow, wide_tkey, wide_tkey ^ 1]:
        assert table.get(tkey, "t", "r") == py.get(tkey, "t", "r"), tkey
    assert table.get(wide_tkey, "t", "r")[R.RESERVED] == 3
    tkeys = np.array([wide_tkey, 1, -1, 0, wide_tkey ^ 2], dtype=np.int64)
    got = table.replay_many(tkeys, ["t"] * 5, ["r"] * 5, T0)
    assert got == py.replay_many(tkeys, ["t"] * 5, ["r"] * 5, T0)
    assert sorted(got) == [0, 1, 2, 3]
    assert table.drop_open(wide_tkey, "t", "r") == py.drop_open(wide_tkey, "t", "r")
    assert table.get(wide_tkey, "t", "r") is None
    assert table.get(1, "t", "r") == py.get(1, "t", "r") is not None
    assert table.wide_rows == 0


@pytest.mark.parametrize("replace", [True, False])
def test_a_slot_out_of_generations_is_retired_and_its_entries_act_on_nothing(
    c: Any, replace: bool
) -> None:
    ttl = 100
    py, table = tables(c, ttl)
    for t in (py, table):
        t.add(0, "t", "old", admission(T0))
    table._set_generation(0, "t", "old", 2**32 - 1)
    if replace:
        # Re-decided: the key moves to a new slot; the old entry (T0) must not release it.
        for t in (py, table):
            t.add(0, "t", "old", admission(T0 + 50, RESERVED=9))
        assert table._generation(0, "t", "old") == 0  # a fresh slot
    else:
        assert table.drop_open(0, "t", "old") == py.drop_open(0, "t", "old")
    # The retired slot is not reused (it would come with its last generation): a new key
    # gets a fresh slot.
    for t in (py, table):
        t.add(0, "t", "new", admission(T0 + 60))
    assert table._generation(0, "t", "new") == 0
    for now in (T0 + ttl, T0 + ttl + 50, T0 + ttl + 60):
        assert table.expire(now) == py.expire(now), now
        assert (len(table), table.open_count) == (len(py), py.open_count)
    assert len(table) == 0


def test_the_index_follows_the_live_count_and_a_full_table_allocates_nothing_more(
    c: Any,
) -> None:
    n, ttl = 50_000, 10**12
    table = c.RequestTable(ttl, ttl, ttl)
    rows = np.array([admission()] * n)
    ids = [f"r{i}" for i in range(n)]
    args = (np.zeros(n, dtype=np.int64), ["t"] * n, ids, rows)
    empty = table.footprint()["bytes"]
    table.add_batch(*args)
    full = table.footprint()["bytes"]
    # 131,072 index entries of 8 B at full (50,000 rows, at most 3/4 full); 16 when empty.
    table.expire(T0 + ttl)
    assert len(table) == 0
    assert table.footprint()["bytes"] == full - (131_072 - 16) * 8
    table.add_batch(*args)  # the same number again: the freed slots are reused
    assert table.footprint()["bytes"] == full > empty
    assert table.wide_rows == 0


def test_memory_is_flat_once_full_under_churn(c: Any) -> None:
    # A TTL of ``live`` ns, one row a ns: once full, each batch forgets as many rows as it
    # adds; five times the live count of churn allocates nothing more.
    live, batch = 20_000, 100
    table = c.RequestTable(live, 10, live)
    sizes = []
    for start in range(0, 6 * live, batch):
        rows = np.array([admission(T0 + start + i) for i in range(batch)])
        ids = [f"r{start + i}" for i in range(batch)]
        table.add_batch(np.zeros(batch, dtype=np.int64), ["t"] * batch, ids, rows)
        table.expire(T0 + start + batch - 1)
        if start >= live:
            assert len(table) == live
            sizes.append(table.footprint()["bytes"])
    assert len(set(sizes)) == 1
    assert table.wide_rows == 0

"""Hand-computed behaviour of RequestTable, run against both builds (``reqlog``).

The random differential tests are in test_reqlog_properties.py; the compiled build's own
pieces (its SipHash-1-3, nothing GC-tracked per request) are at the end of this file.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from controlplane.service import records

from .conftest import compiled

T0 = 1_700_000_000 * 10**9
I64_MAX = 2**63 - 1
I64_MIN = -(2**63)


def mkrow(
    m: ModuleType, state: int | None = None, decided: int = T0, retry: int = 0, fill: int = 0
) -> tuple[int, ...]:
    row = [fill] * m.NF
    row[m.STATE] = m.OPEN if state is None else state
    row[m.DECIDED_NS] = decided
    row[m.RETRY_NS] = retry
    return tuple(row)


def columns(
    keys: list[tuple[int, str, str]],
) -> tuple[np.ndarray[Any, np.dtype[np.int64]], list[str], list[str]]:
    tkeys = np.array([k[0] for k in keys], dtype=np.int64)
    return tkeys, [k[1] for k in keys], [k[2] for k in keys]


def rows_array(rows: list[tuple[int, ...]], nf: int) -> np.ndarray[Any, np.dtype[np.int64]]:
    return np.array(rows, dtype=np.int64).reshape(len(rows), nf)


# --- layout ----------------------------------------------------------------------------


def test_layout_agrees_across_builds_and_with_the_service_records(
    reqlog_both: tuple[ModuleType, ModuleType],
) -> None:
    py, c = reqlog_both
    names = ("STATE", "RETRY_NS", "DECIDED_NS", "ACTUAL", "REFUNDED", "NF", "OPEN", "SETTLED",
             "REJECTED", "COMPACT_SLACK")  # fmt: skip
    for name in names:
        assert getattr(c, name) == getattr(py, name), name
    assert py.__all__ == c.__all__
    for name in ("STATE", "RETRY_NS", "DECIDED_NS", "ACTUAL", "REFUNDED", "OPEN", "SETTLED",
                 "REJECTED"):  # fmt: skip
        assert getattr(py, name) == getattr(records, name), name
    assert records.FIELDS == py.NF


# --- replay ----------------------------------------------------------------------------


def test_open_and_settled_rows_replay_as_stored(reqlog: ModuleType) -> None:
    table = reqlog.RequestTable(100, 50, 30)
    row = mkrow(reqlog, fill=7)
    assert table.get(0, "t", "r") is None
    assert table.replay(0, "t", "r", T0) is None
    table.add(0, "t", "r", row)
    assert (len(table), table.open_count) == (1, 1)
    assert table.get(0, "t", "r") == row
    assert table.replay(0, "t", "r", T0 + 10**12) == row  # replay never expires an admission
    assert all(type(x) is int for x in table.get(0, "t", "r"))
    settled = table.settle(0, "t", "r", 11, 3, T0 + 5)
    expected = list(row)
    expected[reqlog.STATE] = reqlog.SETTLED
    expected[reqlog.ACTUAL] = 11
    expected[reqlog.REFUNDED] = 3
    assert settled == tuple(expected)
    assert table.replay(0, "t", "r", T0 + 6) == settled
    assert (len(table), table.open_count) == (1, 0)


def test_a_refusal_stands_until_its_retry_after_then_is_forgotten(reqlog: ModuleType) -> None:
    table = reqlog.RequestTable(100, 50, 30)
    assert table.remembers_rejections
    refusal = mkrow(reqlog, reqlog.REJECTED, decided=T0, retry=10)
    table.add(3, "t", "r", refusal)
    assert table.open_count == 0
    assert table.replay(3, "t", "r", T0 + 9) == refusal
    assert table.get(3, "t", "r") == refusal
    assert table.replay(3, "t", "r", T0 + 10) is None  # decided + retry_after: decide anew
    assert len(table) == 0
    assert table.get(3, "t", "r") is None


def test_a_replay_window_of_zero_keeps_no_refusals(reqlog: ModuleType) -> None:
    table = reqlog.RequestTable(100, 0, 30)
    assert not table.remembers_rejections
    table.add(0, "t", "r", mkrow(reqlog, reqlog.REJECTED, retry=10))
    assert len(table) == 0
    assert table.replay(0, "t", "r", T0) is None
    # A refusal is not stored, so it does not replace what the key holds either.
    table.add(0, "t", "s", mkrow(reqlog))
    table.add(0, "t", "s", mkrow(reqlog, reqlog.REJECTED, retry=10))
    assert table.get(0, "t", "s") == mkrow(reqlog)
    assert table.open_count == 1
    assert table.footprint()["rejected_fifo"] == 0


def test_refusals_leave_after_the_replay_window_whatever_their_retry_after(
    reqlog: ModuleType,
) -> None:
    table = reqlog.RequestTable(100, 50, 30)
    table.add(0, "t", "long", mkrow(reqlog, reqlog.REJECTED, decided=T0, retry=10**12))
    table.add(0, "t", "short", mkrow(reqlog, reqlog.REJECTED, decided=T0 + 1, retry=5))
    assert table.expire(T0 + 49) == []
    assert len(table) == 2
    assert table.expire(T0 + 50) == []  # refusals are never "released"
    assert table.get(0, "t", "long") is None
    assert table.get(0, "t", "short") is not None
    table.expire(T0 + 51)
    assert len(table) == 0
    assert table.footprint()["rejected_fifo"] == 0


def test_replay_many_answers_the_entries_that_still_stand(reqlog: ModuleType) -> None:
    table = reqlog.RequestTable(100, 50, 30)
    keys = [(0, "t", "a"), (0, "t", "b"), (1, "t", "a"), (0, "u", "a"), (0, "t", "c")]
    tkeys, tenants, requests = columns(keys)
    assert table.replay_many(tkeys, tenants, requests, T0) == {}  # empty table
    admitted = mkrow(reqlog, fill=1)
    refusal = mkrow(reqlog, reqlog.REJECTED, retry=10)
    table.add(0, "t", "a", admitted)
    table.add(0, "u", "a", refusal)
    table.add(0, "t", "c", refusal)
    assert table.replay_many(tkeys, tenants, requests, T0 + 9) == {
        0: admitted, 3: refusal, 4: refusal,
    }  # fmt: skip
    assert table.replay_many(tkeys, tenants, requests, T0 + 10) == {0: admitted}
    assert len(table) == 1  # the refusals past their retry_after were forgotten
    assert table.replay_many(tkeys[:0], [], [], T0) == {}


# --- expiry ----------------------------------------------------------------------------


def test_the_ttl_releases_open_rows_in_decision_order(reqlog: ModuleType) -> None:
    table = reqlog.RequestTable(100, 50, 1_000)  # settled window clamped to the TTL
    rows = [mkrow(reqlog, decided=T0 + i, fill=i) for i in range(6)]
    for i, row in enumerate(rows):
        table.add(0, "t", f"r{i}", row)
    table.settle(0, "t", "r1", 1, 0, T0 + 2)
    assert table.footprint()["settled_fifo"] == 0  # settled window >= TTL: the TTL forgets it
    assert table.drop_open(0, "t", "r4") == rows[4]
    assert table.open_count == 4
    assert table.expire(T0 + 99) == []
    assert table.expire(T0 + 102) == [rows[0], rows[2]]  # decided + ttl <= now; r1 settled
    assert table.get(0, "t", "r1") is None
    assert (len(table), table.open_count) == (2, 2)
    assert table.expire(T0 + 10**6) == [rows[3], rows[5]]
    assert (len(table), table.open_count) == (0, 0)
    assert table.footprint() | {"bytes": 0} == {
        "rows": 0, "admitted_fifo": 0, "settled_fifo": 0, "rejected_fifo": 0, "bytes": 0,
    }  # fmt: skip


def test_settled_ids_are_remembered_for_the_settled_window(reqlog: ModuleType) -> None:
    table = reqlog.RequestTable(100, 50, 30)
    table.add(0, "t", "early", mkrow(reqlog, decided=T0))
    table.add(0, "t", "late", mkrow(reqlog, decided=T0 + 80))
    table.settle(0, "t", "early", 1, 0, T0 + 10)
    table.settle(0, "t", "late", 1, 0, T0 + 90)
    assert table.expire(T0 + 39) == []
    assert len(table) == 2
    assert table.expire(T0 + 40) == []  # settled at + 30
    assert table.get(0, "t", "early") is None
    assert table.get(0, "t", "late") is not None
    # The TTL bounds a settled id too: "late" was decided at T0 + 80, so it goes at
    # T0 + 180 at the latest; here its settled window (T0 + 120) comes first.
    table.expire(T0 + 119)
    assert len(table) == 1
    table.expire(T0 + 120)
    assert len(table) == 0


def test_a_key_decided_again_is_not_expired_by_its_old_entry(reqlog: ModuleType) -> None:
    table = reqlog.RequestTable(100, 50, 30)
    first = mkrow(reqlog, decided=T0, fill=1)
    second = mkrow(reqlog, decided=T0 + 50, fill=2)
    table.add(0, "t", "r", first)
    table.add(0, "t", "r", second)  # replaced while open: still one open row
    assert (len(table), table.open_count) == (1, 1)
    assert table.expire(T0 + 100) == []  # first's entry: the row has a newer version
    assert table.get(0, "t", "r") == second
    assert table.expire(T0 + 150) == [second]
    # A refusal replaced by an admission, and the other way round.
    table.add(0, "t", "x", mkrow(reqlog, reqlog.REJECTED, decided=T0 + 200, retry=10**9))
    table.add(0, "t", "x", mkrow(reqlog, decided=T0 + 210))
    assert table.open_count == 1
    assert table.expire(T0 + 250) == []  # the refusal's replay window passed: not its row
    assert table.get(0, "t", "x") == mkrow(reqlog, decided=T0 + 210)
    table.add(0, "t", "x", mkrow(reqlog, reqlog.REJECTED, decided=T0 + 270, retry=10**9))
    assert table.open_count == 0
    assert table.expire(T0 + 310) == []  # the admission's TTL: not its row either
    assert table.get(0, "t", "x") is not None
    table.expire(T0 + 320)  # the refusal's own replay window
    assert len(table) == 0
    # Settled, forgotten, decided again: the old settled entry leaves the new row alone.
    table.add(0, "t", "y", mkrow(reqlog, decided=T0 + 400))
    table.settle(0, "t", "y", 1, 0, T0 + 400)
    table.drop_open(0, "t", "y")  # not open: no-op
    assert table.get(0, "t", "y") is not None
    table.add(0, "t", "y", mkrow(reqlog, decided=T0 + 410))
    assert table.expire(T0 + 430) == []
    assert table.get(0, "t", "y") == mkrow(reqlog, decided=T0 + 410)


def test_expiry_with_times_out_of_order_follows_insertion_order(reqlog: ModuleType) -> None:
    # Each FIFO is in insertion order: an entry waits behind an older one that expires
    # later (the service stores decisions in time order, so this does not happen there).
    table = reqlog.RequestTable(100, 50, 30)
    a = mkrow(reqlog, decided=T0 + 10, fill=1)
    b = mkrow(reqlog, decided=T0, fill=2)
    table.add(0, "t", "a", a)
    table.add(0, "t", "b", b)
    assert table.expire(T0 + 100) == []
    assert table.expire(T0 + 110) == [a, b]


def test_extreme_times_do_not_overflow(reqlog: ModuleType) -> None:
    # The reference computes over unbounded ints; the compiled build must compare alike.
    table = reqlog.RequestTable(I64_MAX, I64_MAX, I64_MAX)
    refusal = mkrow(reqlog, reqlog.REJECTED, decided=I64_MAX, retry=I64_MAX)
    table.add(0, "t", "r", refusal)
    table.add(0, "t", "o", mkrow(reqlog, decided=I64_MIN))
    assert table.replay(0, "t", "r", I64_MAX) == refusal  # decided + retry > INT64_MAX
    assert table.expire(I64_MIN) == []  # now - ttl far below INT64_MIN
    assert table.expire(-2) == []  # now - ttl = INT64_MIN - 1
    assert table.expire(-1) == [mkrow(reqlog, decided=I64_MIN)]  # now - ttl = INT64_MIN
    assert table.expire(I64_MAX) == []  # the refusal: decided + replay window > INT64_MAX
    assert len(table) == 1
    small = reqlog.RequestTable(1, 1, 0)
    small.add(0, "t", "r", mkrow(reqlog, reqlog.REJECTED, decided=I64_MIN, retry=I64_MIN))
    assert small.replay(0, "t", "r", I64_MIN) is None  # decided + retry < INT64_MIN <= now
    small.add(0, "t", "o", mkrow(reqlog, decided=I64_MIN))
    assert small.expire(I64_MIN) == []
    assert small.expire(I64_MIN + 1) == [mkrow(reqlog, decided=I64_MIN)]


# --- settle and drop_open ----------------------------------------------------------------


def test_settle_needs_an_open_row(reqlog: ModuleType) -> None:
    table = reqlog.RequestTable(100, 50, 30)
    with pytest.raises(KeyError, match="no open reservation"):
        table.settle(0, "t", "missing", 1, 0, T0)
    table.add(0, "t", "refused", mkrow(reqlog, reqlog.REJECTED, retry=10))
    with pytest.raises(KeyError):
        table.settle(0, "t", "refused", 1, 0, T0)
    table.add(0, "t", "r", mkrow(reqlog))
    with pytest.raises(KeyError):
        table.settle(1, "t", "r", 1, 0, T0)  # another tenant slot: another key
    table.settle(0, "t", "r", 1, 0, T0)
    with pytest.raises(KeyError):
        table.settle(0, "t", "r", 1, 0, T0)  # settled already
    assert (len(table), table.open_count) == (2, 0)


def test_drop_open_forgets_only_open_rows(reqlog: ModuleType) -> None:
    table = reqlog.RequestTable(100, 50, 30)
    row = mkrow(reqlog, fill=4)
    table.add(0, "t", "r", row)
    table.add(0, "t", "refused", mkrow(reqlog, reqlog.REJECTED, retry=10))
    table.add(0, "t", "s", row)
    table.settle(0, "t", "s", 1, 0, T0)
    assert table.drop_open(0, "t", "missing") is None
    assert table.drop_open(0, "t", "refused") is None
    assert table.drop_open(0, "t", "s") is None
    assert table.drop_open(0, "t", "r") == row
    assert table.drop_open(0, "t", "r") is None
    assert (len(table), table.open_count) == (2, 0)
    assert table.expire(T0 + 100) == []  # the dropped row's entry acts on nothing


def test_drop_open_where_forgets_the_open_rows_of_the_values_named(reqlog: ModuleType) -> None:
    table = reqlog.RequestTable(100, 50, 30)
    col = 12  # any column; the service names its rows' pool column

    def row(pool: int, state: int | None = None) -> tuple[int, ...]:
        r = list(mkrow(reqlog, state, fill=0))
        r[col] = pool
        return tuple(r)

    table.add(0, "t", "a", row(7))
    table.add(0, "t", "b", row(8))
    table.add(0, "t", "c", row(7))
    table.add(0, "t", "settled", row(7))
    table.settle(0, "t", "settled", 1, 0, T0)
    table.add(0, "t", "refused", row(7, reqlog.REJECTED))
    table.add(0, "t", "gone", row(7))
    table.drop_open(0, "t", "gone")
    assert table.drop_open_where(col, []) == []
    got = table.drop_open_where(col, [7, 99])
    assert [r[col] for r in got] == [7, 7] and len(got) == 2  # a and c, oldest first
    assert table.get(0, "t", "a") is None and table.get(0, "t", "c") is None
    assert table.get(0, "t", "b") is not None and table.get(0, "t", "settled") is not None
    assert table.get(0, "t", "refused") is not None
    assert table.open_count == 1  # b
    assert table.drop_open_where(col, [7]) == []
    b = table.get(0, "t", "b")
    assert table.expire(T0 + 100) == [b]  # only b was still open
    with pytest.raises(ValueError, match="column"):
        table.drop_open_where(reqlog.NF, [1])


# --- keys ------------------------------------------------------------------------------


def test_keys_are_tkey_tenant_and_request_exactly(reqlog: ModuleType) -> None:
    table = reqlog.RequestTable(100, 50, 30)
    keys = [(0, "ab", "c"), (0, "a", "bc"), (0, "abc", ""), (0, "", "abc"), (1, "ab", "c"),
            (-1, "ab", "c"), (0, "é", "x"), (0, "e\u0301", "x"), (0, "\ud800", "x"),
            (0, "\udfff", "x"), (0, "\U0001f600", "x"), (0, "\ud83d\ude00", "x"), (0, "", ""),
            (0, "t" * 1000, "r" * 1000), (I64_MIN, "ab", "c"), (I64_MAX, "ab", "c")]  # fmt: skip
    for i, key in enumerate(keys):
        table.add(*key, mkrow(reqlog, fill=i))
    assert len(table) == len(keys) == table.open_count
    for i, key in enumerate(keys):
        assert table.get(*key) == mkrow(reqlog, fill=i), key
    tkeys, tenants, requests = columns(keys)
    found = table.replay_many(tkeys, tenants, requests, T0)
    assert found == {i: mkrow(reqlog, fill=i) for i in range(len(keys))}


# --- batches ---------------------------------------------------------------------------


def test_add_batch_stores_the_fresh_rows_in_order(reqlog: ModuleType) -> None:
    table = reqlog.RequestTable(100, 50, 30)
    keys = [(0, "t", "a"), (0, "t", "b"), (0, "t", "a"), (0, "t", "c")]
    rows = [mkrow(reqlog, decided=T0 + i, fill=i) for i in range(4)]
    tkeys, tenants, requests = columns(keys)
    table.add_batch(tkeys, tenants, requests, rows_array(rows, reqlog.NF),
                    np.array([1, 0, 1, 1], dtype=np.int8))  # fmt: skip
    assert table.get(0, "t", "a") == rows[2]  # the later of the two, in order
    assert table.get(0, "t", "b") is None  # not fresh
    assert (len(table), table.open_count) == (2, 2)
    table.add_batch(tkeys, tenants, requests, rows_array(rows, reqlog.NF))  # all fresh
    assert (len(table), table.open_count) == (3, 3)
    assert table.footprint()["admitted_fifo"] == 7
    table.add_batch(tkeys[:0], [], [], np.zeros((0, reqlog.NF), dtype=np.int64))
    table.add_batch(tkeys, tenants, requests, rows_array(rows, reqlog.NF),
                    np.zeros(4, dtype=np.bool_))  # fmt: skip
    assert len(table) == 3


def test_add_batch_stops_at_the_first_bad_row(reqlog: ModuleType) -> None:
    # Like ``add`` called per row: the rows before the bad one are stored.
    table = reqlog.RequestTable(100, 50, 30)
    keys = [(0, "t", "a"), (0, "t", "b"), (0, "t", "c")]
    rows = [mkrow(reqlog), mkrow(reqlog, 5), mkrow(reqlog)]
    with pytest.raises(ValueError, match=r"rows\[1\]: state must be OPEN or REJECTED"):
        table.add_batch(*columns(keys), rows_array(rows, reqlog.NF))
    assert len(table) == 1
    assert table.get(0, "t", "a") is not None
    # A bad row that is not fresh is not looked at.
    table.add_batch(*columns(keys), rows_array(rows, reqlog.NF), np.array([1, 0, 1], np.uint8))
    assert len(table) == 2
    assert table.get(0, "t", "b") is None


# --- bad input ---------------------------------------------------------------------------


def _bad_calls(m: ModuleType) -> list[tuple[str, Callable[[Any], object], type, str]]:
    nf = m.NF
    ok = mkrow(m)
    tk1 = np.zeros(1, dtype=np.int64)
    rows1 = np.zeros((1, nf), dtype=np.int64)
    strided = np.zeros((1, 2 * nf), dtype=np.int64)[:, ::2]
    return [
        ("ttl 0", lambda _t: m.RequestTable(0, 1, 1), ValueError, "ttl_ns"),
        ("negative window", lambda _t: m.RequestTable(1, -1, 1), ValueError, "replay_ns"),
        ("float ttl", lambda _t: m.RequestTable(1.0, 1, 1), TypeError, ""),
        ("huge ttl", lambda _t: m.RequestTable(2**63, 1, 1), OverflowError, ""),
        ("short row", lambda t: t.add(0, "t", "r", ok[:-1]), ValueError, "row: expected"),
        (
            "settled row",
            lambda t: t.add(0, "t", "r", mkrow(m, m.SETTLED)),
            ValueError,
            "row: state",
        ),
        ("float in row", lambda t: t.add(0, "t", "r", (*ok[:-1], 1.5)), TypeError, ""),
        ("huge in row", lambda t: t.add(0, "t", "r", (*ok[:-1], 2**63)), OverflowError, ""),
        ("row not sized", lambda t: t.add(0, "t", "r", iter(ok)), TypeError, ""),
        ("huge tkey", lambda t: t.get(2**63, "t", "r"), OverflowError, ""),
        ("float tkey", lambda t: t.get(0.0, "t", "r"), TypeError, ""),
        ("bytes tenant", lambda t: t.get(0, b"t", "r"), TypeError, "tenant_id must be a str"),
        ("int request", lambda t: t.replay(0, "t", 1, T0), TypeError, "request_id must be a str"),
        ("huge now", lambda t: t.replay(0, "t", "r", 2**64), OverflowError, ""),
        ("float now", lambda t: t.expire(1.5), TypeError, ""),
        ("huge actual", lambda t: t.settle(0, "t", "r", 2**63, 0, T0), OverflowError, ""),
        ("tkeys list", lambda t: t.replay_many([0], ["t"], ["r"], T0), TypeError, "tkeys"),
        (
            "tkeys float",
            lambda t: t.replay_many(np.zeros(1), ["t"], ["r"], T0),
            ValueError,
            "tkeys must hold int64",
        ),
        (
            "tkeys 2-D",
            lambda t: t.replay_many(rows1, ["t"], ["r"], T0),
            ValueError,
            "tkeys must be 1-D",
        ),
        ("ids not list", lambda t: t.replay_many(tk1, "t", ["r"], T0), TypeError, "tenant_ids"),
        (
            "lengths",
            lambda t: t.replay_many(tk1, ["t", "u"], ["r", "s"], T0),
            ValueError,
            "same length",
        ),
        (
            "id item",
            lambda t: t.replay_many(tk1, ["t"], [None], T0),
            TypeError,
            r"request_ids\[0\] must be a str",
        ),
        (
            "batch lengths",
            lambda t: t.add_batch(tk1, ["t"], ["r", "s"], rows1),
            ValueError,
            "rows must be",
        ),
        (
            "batch shape",
            lambda t: t.add_batch(tk1, ["t"], ["r"], rows1[:, :-1].copy()),
            ValueError,
            "rows must be",
        ),
        (
            "rows 1-D",
            lambda t: t.add_batch(tk1, ["t"], ["r"], rows1[0]),
            ValueError,
            "rows must be 2-D",
        ),
        (
            "rows strided",
            lambda t: t.add_batch(tk1, ["t"], ["r"], strided),
            ValueError,
            "rows must be C-contiguous",
        ),
        (
            "rows int32",
            lambda t: t.add_batch(tk1, ["t"], ["r"], rows1.astype(np.int32)),
            ValueError,
            "rows must hold int64",
        ),
        (
            "fresh length",
            lambda t: t.add_batch(tk1, ["t"], ["r"], rows1, np.ones(2, np.int8)),
            ValueError,
            "fresh must have",
        ),
        (
            "fresh int64",
            lambda t: t.add_batch(tk1, ["t"], ["r"], rows1, tk1),
            ValueError,
            "fresh must hold 1-byte",
        ),
        (
            "batch tenant",
            lambda t: t.add_batch(tk1, [1], ["r"], rows1),
            TypeError,
            r"tenant_ids\[0\]",
        ),
    ]


def test_bad_input_raises_the_same_error_naming_the_argument(
    reqlog_both: tuple[ModuleType, ModuleType],
) -> None:
    py, c = reqlog_both
    for (name, call, exc, match), (_, c_call, _, _) in zip(_bad_calls(py), _bad_calls(c),
                                                            strict=True):  # fmt: skip
        for module, fn in ((py, call), (c, c_call)):
            table = module.RequestTable(100, 50, 30)
            table.add(0, "t", "x", mkrow(module))  # not empty: replay_many looks at entries
            with pytest.raises(exc, match=match or None):
                fn(table)
            assert (len(table), table.open_count) == (1, 1), (name, module.__name__)


def test_replay_many_on_an_empty_table_looks_at_no_entry(reqlog: ModuleType) -> None:
    table = reqlog.RequestTable(100, 50, 30)
    assert table.replay_many(np.zeros(1, dtype=np.int64), [1], [None], T0) == {}


# --- growth and churn --------------------------------------------------------------------


def test_thousands_of_rows_and_deletions_past_the_initial_capacity(reqlog: ModuleType) -> None:
    table = reqlog.RequestTable(10**6, 10**6, 10)
    rng = np.random.default_rng(7)
    model: dict[tuple[int, str, str], tuple[int, ...]] = {}
    now = T0
    for step in range(6):
        keys = [(int(rng.integers(0, 4)), f"t{rng.integers(0, 3)}", f"r{rng.integers(0, 20_000)}")
                for _ in range(3_000)]  # fmt: skip
        rows = [mkrow(reqlog, decided=now, fill=step * 10_000 + i) for i in range(3_000)]
        table.add_batch(*columns(keys), rows_array(rows, reqlog.NF))
        model.update(zip(keys, rows, strict=True))
        victims = list(model)[:: 3 + step]
        for key in victims[::2]:
            assert table.drop_open(*key) == model.pop(key)
        for key in victims[1::2]:
            table.settle(*key, 1, 0, now)
            del model[key]
        now += 20
        assert table.expire(now) == []  # the settled ones go: settled window 10 ns
        assert len(table) == len(model) == table.open_count
    for key, row in model.items():
        assert table.get(*key) == row
    sample = list(model)[:500]
    assert table.replay_many(*columns(sample), now) == {
        i: model[key] for i, key in enumerate(sample)
    }
    assert table.get(9, "t0", "r1") is None
    released = table.expire(now + 10**6)
    assert len(released) == len(model)
    assert (len(table), table.open_count) == (0, 0)


def test_footprint_stays_bounded_under_churn(reqlog: ModuleType) -> None:
    # Settled ids leave after 5 ns, long before the TTL: the admitted FIFO's entries of
    # forgotten rows would pile up until the TTL without compaction.
    table = reqlog.RequestTable(10**12, 0, 5)
    n = 500
    rows = rows_array([mkrow(reqlog, decided=T0)] * n, reqlog.NF)
    tenants = ["t"] * n
    tkeys = np.zeros(n, dtype=np.int64)
    sizes = []  # the table's bytes: they go up and down with the FIFO between compactions
    for round_ in range(60):
        requests = [f"{round_}-{i}" for i in range(n)]
        table.add_batch(tkeys, tenants, requests, rows)
        for r in requests:
            table.settle(0, "t", r, 1, 0, T0 + round_)
        table.expire(T0 + round_ + 5)
        fp = table.footprint()
        assert fp["rows"] == len(table) <= 5 * n
        assert fp["admitted_fifo"] <= 2 * fp["rows"] + reqlog.COMPACT_SLACK + n
        sizes.append(fp["bytes"])
    assert max(sizes[30:]) <= 1.1 * max(sizes[:30])


# --- the compiled build's own pieces -------------------------------------------------------

_HASHES = """
import sys
data = [bytes(range(n)) for n in range(1, 65)] + [bytes([255 - n]) * n for n in range(1, 65)]
data += [("é" * n).encode() for n in range(1, 40)]
for d in data:
    print(d.hex(), hash(d))
"""


def _cpython_hash_key(seed: int) -> tuple[int, int]:
    """CPython's SipHash key under PYTHONHASHSEED=seed: 0 gives a zero key; any other
    seed fills the hash secret from the LCG x = x * 214013 + 2531011 (mod 2**32),
    one byte (x >> 16) & 0xff at a time (Python/bootstrap_hash.c, lcg_urandom)."""
    if seed == 0:
        return 0, 0
    x = seed
    secret = bytearray()
    for _ in range(16):
        x = (x * 214013 + 2531011) & 0xFFFFFFFF
        secret.append((x >> 16) & 0xFF)
    return int.from_bytes(secret[:8], "little"), int.from_bytes(secret[8:], "little")


@pytest.mark.parametrize("seed", [0, 12345])
def test_siphash13_is_cpythons_bytes_hash(seed: int) -> None:
    """CPython hashes bytes with SipHash-1-3 under its hash secret; PYTHONHASHSEED fixes the
    secret (all zeros for 0).  Its hash is the signed 64-bit value, -1 mapped to -2; the
    empty string hashes to 0 there by a special case, so lengths start at 1."""
    c = compiled("_reqlog_c")
    if sys.hash_info.algorithm != "siphash13":
        pytest.skip(f"this CPython hashes with {sys.hash_info.algorithm}")
    env = dict(os.environ, PYTHONHASHSEED=str(seed))
    out = subprocess.run([sys.executable, "-c", _HASHES], env=env, capture_output=True,
                         text=True, check=True, timeout=60).stdout  # fmt: skip
    key0, key1 = _cpython_hash_key(seed)
    lines = out.splitlines()
    assert len(lines) == 64 + 64 + 39
    for line in lines:
        hex_data, expected = line.split()
        value = c._siphash13(key0, key1, bytes.fromhex(hex_data))
        assert 0 <= value < 2**64
        signed = value - 2**64 if value >= 2**63 else value
        assert (-2 if signed == -1 else signed) == int(expected), hex_data


def test_siphash13_over_pieces_is_siphash13_of_the_whole() -> None:
    c = compiled("_reqlog_c")
    rng = np.random.default_rng(3)
    for n in range(0, 70):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        key = (int(rng.integers(0, 2**63)) * 2 + 1, int(rng.integers(0, 2**63)))
        whole = c._siphash13(*key, data)
        cuts = sorted(int(x) for x in rng.integers(0, n + 1, 4))
        pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, n], strict=True)]
        assert c._siphash13_chunks(*key, pieces) == whole
        assert c._siphash13_chunks(*key, [data[i : i + 1] for i in range(n)]) == whole
        assert c._siphash13(key[0] ^ 1, key[1], data) != whole  # the key matters


def test_the_compiled_table_holds_no_python_object_per_request() -> None:
    c = compiled("_reqlog_c")
    table = c.RequestTable(10**12, 10**12, 10**12)
    assert not gc.is_tracked(table)
    gc.collect()
    before = len(gc.get_objects())
    n = 20_000
    rows = rows_array([mkrow(c, decided=T0)] * n, c.NF)
    rows[:, records.ARRIVED_NS] = T0  # no wait: every column fits its slot
    tenants = ["t"] * n
    requests = [f"r{i}" for i in range(n)]
    table.add_batch(np.zeros(n, dtype=np.int64), tenants, requests, rows)
    del rows, tenants, requests
    gc.collect()
    assert len(table) == n
    assert len(gc.get_objects()) - before < 100
    assert table.wide_rows == 0
    # 10 blocks of 2,048 slots (121 B: the key, the generation and the narrow row) and
    # their 16 pointers, an index of 32,768 entries (8 B; at most 3/4 full), a ring of
    # 32,768 entries (16 B), the multiplier dictionary (room for 8 values, an index of
    # 32 entries of 4 B): 163 B per row here.
    assert c.SLOT_BYTES == 121
    expected = 10 * 2048 * 121 + 16 * 8 + 32768 * 8 + 32768 * 16 + 8 * 8 + 32 * 4
    assert table.footprint()["bytes"] == expected

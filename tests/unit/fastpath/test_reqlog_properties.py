"""Property tests of the request table: the compiled build and the reference agree.

``RequestTableMachine`` drives both builds with the same random operation sequences (add,
add_batch with random fresh masks, replay, replay_many, get, settle, drop_open, expire at
advancing times; duplicate keys over a few tenants and tenant slots; small TTL, replay
and settled windows so that rows expire all the time, settled windows at or past the TTL
and replay windows of 0 included; now and then an invalid argument), asserting identical
results or identical exception types, and identical len, open_count and FIFO sizes after
every step.  ``test_compaction_changes_no_answer`` drives enough churn through both to
compact the admitted FIFO many times.

Rows mix values that fit the compiled build's narrow columns and values at and one past
each column's range (``EDGES``), keys with a tkey wider than 32 bits whose low bits equal
another's, and settlements whose usage does not fit 32 bits, so that rows kept narrow,
rows kept whole in the overflow block and rows moved there by a settlement all meet the
same operations as in the reference.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, ClassVar

import numpy as np
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from controlplane.service import records as R
from fastpath import _reqlog_py
from fastpath._reqlog_py import DECIDED_NS, NF, OPEN, REJECTED, RETRY_NS, SETTLED, STATE

from .conftest import compiled

I64_MAX = 2**63 - 1
T0 = 10**18


def _call(fn: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return ("ok", fn())
    except (ValueError, KeyError, TypeError, OverflowError) as exc:
        return ("raised", type(exc))


# Few keys, so that the same key comes back often; ids that hash alike under a naive
# concatenation ("ab"+"c", "a"+"bc"), non-ASCII and a lone surrogate.
# 2**32 + 1 has the low 32 bits of 1: the compiled build keeps it whole, apart from 1.
tkeys_st = st.sampled_from([-1, 0, 1, 2**32 + 1])
tenants_st = st.sampled_from(["a", "ab", "é", ""])
requests_st = st.sampled_from(["c", "bc", "1", "2", "3", "", "é\ud800", "x" * 40])
keys_st = st.tuples(tkeys_st, tenants_st, requests_st)
odd_keys_st = st.one_of(
    *[keys_st] * 12,
    st.tuples(st.sampled_from([2**63, 1.0]), tenants_st, requests_st),
    st.tuples(tkeys_st, st.sampled_from([b"a", None, 1]), requests_st),
)


I8, U16, I32 = (-(2**7), 2**7 - 1), (0, 2**16 - 1), (-(2**31), 2**31 - 1)
# The compiled build's narrow columns and their ranges (test_reqlog.py checks this is its
# _NARROW); ARRIVED_NS: the range of DECIDED_NS - ARRIVED_NS.
NARROW = {
    R.REASON: I8, R.SHADOW_REASON: I8, R.FRESHNESS: I8, R.SHED: I8,
    R.LANE: U16, R.POOL: U16, R.MODEL: U16,
    R.RESERVED: I32, R.GRANTED: I32, R.SLOT: I32, R.WINDOW: I32, R.ACTUAL: I32,
    R.REFUNDED: I32, R.DEGRADED_CAP: I32, R.SCORE_PPM: I32,
    R.ARRIVED_NS: (0, 2**32 - 1),
}  # fmt: skip
# (column, value): each range's two ends and one past each; the 64-bit columns' ends.
EDGES = [(col, v) for col, (lo, hi) in NARROW.items() for v in (lo - 1, lo, hi, hi + 1)]
EDGES += [(col, v) for col in (R.RID, R.BUCKET, R.HOUR, R.DAY, R.MULTIPLIER)
          for v in (-(2**63), 2**63 - 1)]  # fmt: skip

# A row as (state, decided - now, retry_after, filler, wait, edge), made into NF ints by
# ``mkrow``: every other column holds the filler, ARRIVED_NS is decided - wait, and the
# edge (column, value) if any is written last.
RowSpec = tuple[int, int, int, int, int, tuple[int, int] | None]
row_specs = st.tuples(
    st.sampled_from([OPEN, OPEN, REJECTED, REJECTED]),
    st.integers(-3, 3),
    st.one_of(st.integers(0, 12), st.just(I64_MAX)),
    st.sampled_from([0, 1, -1, 12345]),
    st.sampled_from([0, 0, 5, 2**32 - 1, 2**32, -1]),
    st.one_of(*[st.none()] * 3, st.sampled_from(EDGES)),
)
bad_states = st.sampled_from([OPEN, OPEN, OPEN, REJECTED, REJECTED, REJECTED, SETTLED, 7])


def mkrow(spec: RowSpec, now: int) -> tuple[int, ...]:
    state, offset, retry, fill, wait, edge = spec
    row = [fill] * NF
    row[STATE] = state
    row[DECIDED_NS] = now + offset
    row[RETRY_NS] = retry
    row[R.ARRIVED_NS] = now + offset - wait
    if edge is not None:
        col, value = edge
        row[col] = row[DECIDED_NS] - value if col == R.ARRIVED_NS else value
    return tuple(row)


class RequestTableMachine(RuleBasedStateMachine):
    compiled: ClassVar[Any]  # the compiled module, set on a subclass by the test

    def __init__(self) -> None:
        super().__init__()
        self.py: Any = None
        self.c: Any = None
        self.now = T0

    @initialize(
        ttl=st.integers(1, 25),
        replay=st.one_of(st.just(0), st.integers(1, 25)),
        settled=st.one_of(st.just(0), st.integers(1, 40)),
    )
    def start(self, ttl: int, replay: int, settled: int) -> None:
        self.py = _reqlog_py.RequestTable(ttl, replay, settled)
        self.c = self.compiled.RequestTable(ttl, replay, settled)

    def both(self, name: str, *args: Any) -> Any:
        expected = _call(lambda: getattr(self.py, name)(*args))
        actual = _call(lambda: getattr(self.c, name)(*args))
        assert actual == expected, (name, args)
        return expected[1] if expected[0] == "ok" else None

    @rule(key=odd_keys_st, spec=row_specs, state=bad_states, shape=st.integers(0, 20))
    def add(self, key: tuple[Any, ...], spec: RowSpec, state: int, shape: int) -> None:
        row: Any = mkrow((state, *spec[1:]), self.now)
        if shape == 0:
            row = row[:-1]  # too short
        elif shape == 1:
            row = (*row[:-1], 2**63)  # out of int64
        elif shape == 2:
            row = list(row)  # any sequence will do
        self.both("add", *key, row)

    @rule(
        entries=st.lists(st.tuples(keys_st, row_specs, st.integers(0, 1)), max_size=7),
        mask=st.sampled_from(["none", "int8", "bool", "uint8"]),
        bad=st.one_of(*[st.just(-1)] * 5, st.integers(0, 6)),  # now and then a bad row
    )
    def add_batch(
        self, entries: list[tuple[tuple[int, str, str], RowSpec, int]], mask: str, bad: int
    ) -> None:
        n = len(entries)
        table = np.array([mkrow(spec, self.now) for _, spec, _ in entries], dtype=np.int64)
        if 0 <= bad < n:
            table[bad, STATE] = SETTLED  # not a state a decision is stored in
        fresh: np.ndarray[Any, Any] | None = None
        if mask != "none":
            dtype = {"int8": np.int8, "bool": np.bool_, "uint8": np.uint8}[mask]
            fresh = np.array([bit for _, _, bit in entries], dtype=dtype)
        self.both(
            "add_batch",
            np.array([key[0] for key, _, _ in entries], dtype=np.int64),
            [key[1] for key, _, _ in entries],
            [key[2] for key, _, _ in entries],
            table.reshape(n, NF),
            fresh,
        )

    @rule(key=odd_keys_st, ahead=st.integers(-2, 15))
    def replay(self, key: tuple[Any, ...], ahead: int) -> None:
        self.both("replay", *key, self.now + ahead)

    @rule(keys=st.lists(keys_st, max_size=8), ahead=st.integers(-2, 15))
    def replay_many(self, keys: list[tuple[int, str, str]], ahead: int) -> None:
        self.both(
            "replay_many",
            np.array([k[0] for k in keys], dtype=np.int64),
            [k[1] for k in keys],
            [k[2] for k in keys],
            self.now + ahead,
        )

    @rule(key=odd_keys_st)
    def get(self, key: tuple[Any, ...]) -> None:
        self.both("get", *key)

    @rule(
        key=odd_keys_st,
        actual=st.one_of(st.integers(0, 100), st.sampled_from([2**63, 2**31 - 1, 2**31])),
        refunded=st.one_of(st.integers(0, 100), st.sampled_from([-(2**31), -(2**31) - 1])),
        ahead=st.integers(-2, 3),
    )
    def settle(self, key: tuple[Any, ...], actual: int, refunded: int, ahead: int) -> None:
        self.both("settle", *key, actual, refunded, self.now + ahead)

    @precondition(lambda self: self.py is not None and self.py.open_count > 0)
    @rule(data=st.data(), ahead=st.integers(0, 3))
    def settle_open(self, data: st.DataObject, ahead: int) -> None:
        """Settle a row that is open (random keys mostly miss them)."""
        open_keys = sorted(k for k, (_, row) in self.py._rows.items() if row[STATE] == OPEN)
        key = data.draw(st.sampled_from(open_keys))
        actual = data.draw(st.sampled_from([5, 5, 2**31, -(2**31) - 1]))
        self.both("settle", *key, actual, 1, self.now + ahead)

    @rule(key=odd_keys_st)
    def drop_open(self, key: tuple[Any, ...]) -> None:
        self.both("drop_open", *key)

    @rule(dt=st.one_of(st.integers(0, 4), st.integers(0, 40)))
    def expire(self, dt: int) -> None:
        self.now += dt
        self.both("expire", self.now)

    @precondition(lambda self: self.py is not None and len(self.py) > 0)
    @rule(data=st.data(), early=st.integers(0, 1))
    def expire_at_an_edge(self, data: st.DataObject, early: int) -> None:
        """Expire exactly when (or 1 ns before) a FIFO entry's window ends, read from
        the reference's FIFOs, where an off-by-one would show."""
        py = self.py
        ends = [t + py._ttl_ns for t, _, _ in py._admitted]
        ends += [t + py._settled_ns for t, _, _ in py._settled]
        ends += [t + py._replay_ns for t, _, _ in py._rejected]
        ends = sorted(e - early for e in ends if e - early >= self.now)
        if ends:
            self.now = data.draw(st.sampled_from(ends[:5]))
            self.both("expire", self.now)

    @precondition(
        lambda self: (
            self.py is not None and any(row[STATE] == REJECTED for _, row in self.py._rows.values())
        )
    )
    @rule(data=st.data(), early=st.integers(0, 1))
    def replay_at_retry_after(self, data: st.DataObject, early: int) -> None:
        """Replay a refusal exactly when (or 1 ns before) its retry_after passes."""
        refused = sorted(
            (key, row) for key, (_, row) in self.py._rows.items() if row[STATE] == REJECTED
        )
        key, row = data.draw(st.sampled_from(refused))
        self.both("replay", *key, min(row[DECIDED_NS] + row[RETRY_NS], I64_MAX) - early)

    @rule(now=st.sampled_from([1.5, 2**63, -(2**63) - 1]))
    def expire_bad(self, now: Any) -> None:
        self.both("expire", now)

    @invariant()
    def same_state(self) -> None:
        if self.py is None:
            return
        assert (len(self.c), self.c.open_count, self.c.remembers_rejections) == (
            len(self.py), self.py.open_count, self.py.remembers_rejections,
        )  # fmt: skip
        c_fp, py_fp = self.c.footprint(), self.py.footprint()
        assert c_fp.keys() == py_fp.keys()
        c_fp.pop("bytes")
        py_fp.pop("bytes")
        assert c_fp == py_fp
        assert py_fp["rows"] == len(self.py)


def test_request_table_random_operation_sequences() -> None:
    class Machine(RequestTableMachine):
        compiled = compiled("_reqlog_c")

    run_state_machine_as_test(
        Machine,
        settings=settings(
            max_examples=100,
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
            phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
        ),
    )


def _churn_step(
    table: Any,
    tkeys: np.ndarray[Any, np.dtype[np.int64]],
    tenants: list[str],
    ids: list[str],
    settle: np.ndarray[Any, np.dtype[np.intp]],
    now: int,
    expire_at: int,
) -> list[Any]:
    got: list[Any] = []
    for i in settle.tolist():
        got.append(_call(partial(table.settle, int(tkeys[i]), tenants[i], ids[i], 1, 0, now)))
    got.append(_call(lambda: table.replay_many(tkeys, tenants, ids, now + 1)))
    got.append(_call(lambda: table.expire(expire_at)))
    got.append(_call(lambda: table.replay_many(tkeys, tenants, ids, now + 2)))
    fp = table.footprint()
    fp.pop("bytes")
    got.append(("footprint", fp, len(table), table.open_count))
    return got


def test_compaction_changes_no_answer() -> None:
    """Enough churn for the admitted FIFO to be compacted many times (settled window much
    shorter than the TTL), with the same answers and FIFO sizes from both builds."""
    c = compiled("_reqlog_c")
    rng = np.random.default_rng(11)
    tables = (_reqlog_py.RequestTable(400, 3, 2), c.RequestTable(400, 3, 2))
    compactions = 0
    previous_fifo = 0
    now = T0
    for step in range(120):
        n = 800
        ids = [f"r{x}" for x in rng.integers(0, 4_000, n)]
        tenants = [str(x) for x in rng.integers(0, 3, n)]
        tkeys = rng.integers(-1, 2, n).astype(np.int64)
        table = np.zeros((n, NF), dtype=np.int64)
        table[:, STATE] = rng.choice([OPEN, OPEN, OPEN, REJECTED], n)
        table[:, DECIDED_NS] = now
        table[:, RETRY_NS] = rng.integers(0, 5, n)
        fresh = rng.integers(0, 2, n).astype(np.int8)
        for t in tables:
            t.add_batch(tkeys, tenants, ids, table, fresh)
        settle = np.flatnonzero(rng.random(n) < 0.97)
        expire_at = now + int(rng.integers(0, 3))
        results = [_churn_step(t, tkeys, tenants, ids, settle, now, expire_at) for t in tables]
        assert results[0] == results[1], step
        fifo = results[0][-1][1]["admitted_fifo"]
        compactions += fifo < previous_fifo  # nothing reaches its TTL: only compaction
        previous_fifo = fifo
        now += 3
    assert compactions >= 5

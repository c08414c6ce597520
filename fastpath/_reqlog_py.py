"""Pure-Python reference of the request table: what the plane remembers per request.

This module defines the semantics; ``_reqlog_c.pyx`` is the compiled copy and must give
the same answers (the property tests drive both with the same operation sequences,
expiry and duplicates included).

A record is a *row* of ``NF`` 64-bit integers: the service's record layout
(``controlplane.service.records``) with its strings interned to small integers and its
float stored as its IEEE-754 bits, so nothing per request is a Python object in the
compiled build. The table reads only ``STATE``, ``RETRY_NS``, ``ACTUAL`` and
``REFUNDED``; every other column is carried as given.

A row is keyed by ``(tkey, tenant_id, request_id)``: ``tkey`` is the tenant's slot in
the bucket table (never reused, -1 for a tenant that is not configured). This
reference keys by the exact strings; the compiled build by ``tkey`` compared exactly
plus a 128-bit keyed hash of the two ids (see ``_reqlog_c.pyx``).

This reference keeps rows as tuples of Python ints; the compiled build keeps each row
in narrow columns of a fixed-size slot (and a row with a value that does not fit whole,
in an overflow block), so every row reads back exactly as stored in both builds.

Expiry is exact and O(1) per record: the reservation TTL, the settled-id window and
the replay window are constants, so records expire in the order they were made (or
settled), and a FIFO per kind is an exact expiry queue. Each stored row gets a
*version* (a counter of the table); a FIFO entry acts only on the row of the version
it was made for, so a key re-decided since is left alone.

* an admitted row (``STATE`` = ``OPEN``) is kept until ``decided + ttl``, settled or
  not, and once settled only until ``settled_at + settled_window`` as well;
* a refusal (``REJECTED``) is kept until ``decided + replay_window`` (not at all with
  a window of 0), and ``replay`` stops answering it once its ``retry_after`` passed.

Arguments are checked as the compiled build checks them (the ``fastpath._ints``
convention): integers with ``operator.index`` and the int64 range (``TypeError``,
``OverflowError``), ids must be ``str`` and id columns lists (or tuples) of ``str``
(``TypeError``), ``tkeys`` a 1-D int64 buffer, ``rows`` a C-contiguous 2-D int64 buffer
and ``fresh`` a 1-D buffer of 1-byte items (``int8``, ``uint8`` or ``bool``), each
error naming its argument.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Final, cast

from fastpath._ints import i64

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    from typing_extensions import Buffer

__all__ = ["NF", "OPEN", "REJECTED", "SETTLED", "RequestTable"]

# Row layout: the columns the table reads (the rest it carries). The service's
# records module uses the same indexes (a test checks they agree).
STATE: Final = 0
RETRY_NS: Final = 2
DECIDED_NS: Final = 11
ACTUAL: Final = 16
REFUNDED: Final = 17
NF: Final = 24

# States.
OPEN: Final = 0  # admitted, reservation not settled yet
SETTLED: Final = 1
REJECTED: Final = 2

# Dead entries tolerated in the admitted FIFO beyond twice the live rows.
COMPACT_SLACK: Final = 4096

Row = tuple[int, ...]
_Key = tuple[int, str, str]


# Buffer formats of a native signed 64-bit integer (numpy int64 shows as "l") and of the
# 1-byte items ``fresh`` may hold: the native ones, which memoryview.tolist reads.
_I64_FORMATS: Final = frozenset({"q", "@q", "l", "@l"})
_BYTE_FORMATS: Final = frozenset({"b", "@b", "B", "@B", "?", "@?"})


def _check_row(row: Row, name: str = "row") -> Row:
    if len(row) != NF:
        raise ValueError(f"{name}: expected {NF} columns, got {len(row)}")
    checked = tuple(i64(x) for x in row)
    if checked[STATE] not in (OPEN, REJECTED):
        raise ValueError(f"{name}: state must be OPEN or REJECTED, got {checked[STATE]}")
    return checked


def _check_id(name: str, value: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    return value


def _key(tkey: int, tenant_id: str, request_id: str) -> _Key:
    return (i64(tkey), _check_id("tenant_id", tenant_id), _check_id("request_id", request_id))


def _check_ids(name: str, ids: list[str]) -> list[str]:
    if not isinstance(ids, list | tuple):
        raise TypeError(f"{name} must be a list of str, got {type(ids).__name__}")
    return ids


def _view(obj: Any, name: str, ndim: int, int64: bool) -> memoryview:
    """``obj`` as a buffer of ``ndim`` dimensions of int64 items, or of 1-byte items."""
    what = "int64" if int64 else "1-byte"
    try:
        view = memoryview(cast("Buffer", obj))  # ndarray is a Buffer at runtime
    except TypeError as exc:
        raise TypeError(f"{name} must be a {ndim}-D {what} buffer (numpy array)") from exc
    if view.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got {view.ndim} dimensions")
    if view.suboffsets:
        raise ValueError(f"{name} must not be an indirect buffer")
    formats, itemsize = (_I64_FORMATS, 8) if int64 else (_BYTE_FORMATS, 1)
    if view.format not in formats or view.itemsize != itemsize:
        raise ValueError(f"{name} must hold {what} items, got format {view.format!r}")
    return view


class RequestTable:
    """Rows by (tkey, tenant id, request id), with exact FIFO expiry (module doc)."""

    def __init__(self, ttl_ns: int, replay_ns: int, settled_ns: int) -> None:
        ttl_ns, replay_ns, settled_ns = i64(ttl_ns), i64(replay_ns), i64(settled_ns)
        if ttl_ns <= 0:
            raise ValueError(f"ttl_ns must be positive, got {ttl_ns}")
        if replay_ns < 0 or settled_ns < 0:
            raise ValueError("replay_ns and settled_ns must not be negative")
        self._rows: dict[_Key, tuple[int, Row]] = {}  # key -> (version, row)
        self._admitted: deque[tuple[int, _Key, int]] = deque()  # (decided, key, version)
        self._rejected: deque[tuple[int, _Key, int]] = deque()
        self._settled: deque[tuple[int, _Key, int]] = deque()  # (settled at, key, version)
        self._ttl_ns = ttl_ns
        self._replay_ns = replay_ns
        self._settled_ns = min(settled_ns, ttl_ns)
        self._version = 0
        self._open = 0

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def open_count(self) -> int:
        """Rows admitted and not settled, dropped or expired."""
        return self._open

    @property
    def remembers_rejections(self) -> bool:
        return self._replay_ns > 0

    def get(self, tkey: int, tenant_id: str, request_id: str) -> Row | None:
        got = self._rows.get(_key(tkey, tenant_id, request_id))
        return None if got is None else got[1]

    def replay(self, tkey: int, tenant_id: str, request_id: str, now: int) -> Row | None:
        """The earlier decision if it still stands. A refusal stands until its
        retry_after has passed; then it is forgotten (decided anew)."""
        key = _key(tkey, tenant_id, request_id)
        return self._replay(key, i64(now))

    def _replay(self, key: _Key, now: int) -> Row | None:
        got = self._rows.get(key)
        if got is None:
            return None
        row = got[1]
        if row[STATE] == REJECTED and now >= row[DECIDED_NS] + row[RETRY_NS]:
            del self._rows[key]
            return None
        return row

    def replay_many(
        self,
        tkeys: npt.NDArray[np.int64],
        tenant_ids: list[str],
        request_ids: list[str],
        now: int,
    ) -> dict[int, Row]:
        """``replay`` for a batch: index -> earlier decision, for the entries
        whose decision still stands."""
        now = i64(now)
        v_tkeys = _view(tkeys, "tkeys", 1, True)
        _check_ids("tenant_ids", tenant_ids)
        _check_ids("request_ids", request_ids)
        n = len(request_ids)
        if len(v_tkeys) != n or len(tenant_ids) != n:
            raise ValueError("tkeys, tenant_ids and request_ids must have the same length")
        out: dict[int, Row] = {}
        if not self._rows:
            return out
        keys = v_tkeys.tolist()
        for i in range(n):
            key = (
                keys[i],
                _check_id(f"tenant_ids[{i}]", tenant_ids[i]),
                _check_id(f"request_ids[{i}]", request_ids[i]),
            )
            row = self._replay(key, now)
            if row is not None:
                out[i] = row
        return out

    def add(self, tkey: int, tenant_id: str, request_id: str, row: Row) -> None:
        """Store a fresh decision (replacing any row of the key). A refusal is
        kept only with a replay window."""
        key = _key(tkey, tenant_id, request_id)
        self._store(key, _check_row(row))

    def _store(self, key: _Key, row: Row) -> None:
        if row[STATE] == REJECTED:
            if self._replay_ns <= 0:
                return
            fifo = self._rejected
        else:
            fifo = self._admitted
            self._open += 1
        old = self._rows.get(key)
        if old is not None and old[1][STATE] == OPEN:
            self._open -= 1  # replaced while open: it is no longer open
        self._version += 1
        self._rows[key] = (self._version, row)
        fifo.append((row[DECIDED_NS], key, self._version))

    def add_batch(
        self,
        tkeys: npt.NDArray[np.int64],
        tenant_ids: list[str],
        request_ids: list[str],
        rows: npt.NDArray[np.int64],
        fresh: npt.NDArray[np.int8] | None = None,
    ) -> None:
        """``add`` for row ``i`` of the (n, NF) array ``rows``, in order, for
        every ``i`` with ``fresh[i]`` (all when ``fresh`` is None)."""
        v_tkeys = _view(tkeys, "tkeys", 1, True)
        _check_ids("tenant_ids", tenant_ids)
        _check_ids("request_ids", request_ids)
        v_rows = _view(rows, "rows", 2, True)
        if not v_rows.c_contiguous:
            raise ValueError("rows must be C-contiguous")
        v_fresh = None if fresh is None else _view(fresh, "fresh", 1, False)
        n = len(request_ids)
        if len(v_tkeys) != n or len(tenant_ids) != n or v_rows.shape != (n, NF):
            raise ValueError(f"rows must be ({n}, {NF}) and every column of length {n}")
        if v_fresh is not None and len(v_fresh) != n:
            raise ValueError(f"fresh must have {n} entries")
        keys = v_tkeys.tolist()
        mask = None if v_fresh is None else v_fresh.tolist()
        table = cast("list[list[int]]", v_rows.tolist())  # 2-D: a list of rows
        for i in range(n):
            if mask is None or mask[i]:
                key = (
                    keys[i],
                    _check_id(f"tenant_ids[{i}]", tenant_ids[i]),
                    _check_id(f"request_ids[{i}]", request_ids[i]),
                )
                self._store(key, _check_row(tuple(table[i]), f"rows[{i}]"))

    def settle(
        self, tkey: int, tenant_id: str, request_id: str, actual: int, refunded: int, now: int
    ) -> Row:
        """Mark an open row settled with its real usage and refund; it is then
        remembered for the settled-id window (and never past the TTL)."""
        key = _key(tkey, tenant_id, request_id)
        actual, refunded, now = i64(actual), i64(refunded), i64(now)
        got = self._rows.get(key)
        if got is None or got[1][STATE] != OPEN:
            raise KeyError(f"no open reservation for {key!r}")
        version, row = got
        done = list(row)
        done[STATE] = SETTLED
        done[ACTUAL] = actual
        done[REFUNDED] = refunded
        settled_row = tuple(done)
        self._rows[key] = (version, settled_row)
        self._open -= 1
        if self._settled_ns < self._ttl_ns:  # else the TTL's FIFO forgets it
            self._settled.append((now, key, version))
        return settled_row

    def drop_open(self, tkey: int, tenant_id: str, request_id: str) -> Row | None:
        """Forget an open row (its caller never learned of it); None if the
        key has no open row."""
        key = _key(tkey, tenant_id, request_id)
        got = self._rows.get(key)
        if got is None or got[1][STATE] != OPEN:
            return None
        del self._rows[key]
        self._open -= 1
        return got[1]

    def drop_open_where(self, column: int, values: Iterable[int]) -> list[Row]:
        """Forget every open row whose ``column`` holds one of ``values``
        (the rows of pools whose cell moved to another replica); return
        them, oldest first. One pass over the admitted rows: a rare call."""
        column = i64(column)
        if not 0 <= column < NF:
            raise ValueError(f"column must be in [0, {NF}), got {column}")
        wanted = {i64(v) for v in values}
        out: list[Row] = []
        if not wanted:
            return out
        rows = self._rows
        for _, key, version in list(self._admitted):
            got = rows.get(key)
            if got is None or got[0] != version:
                continue
            row = got[1]
            if row[STATE] == OPEN and row[column] in wanted:
                out.append(row)
                self._open -= 1
                del rows[key]
        return out

    def expire(self, now: int) -> list[Row]:
        """Forget rows past their window; return the open ones among them
        (their reservations end without a Complete), in expiry order."""
        now = i64(now)
        released: list[Row] = []
        rows = self._rows
        horizon = now - self._ttl_ns
        fifo = self._admitted
        while fifo and fifo[0][0] <= horizon:
            _, key, version = fifo.popleft()
            got = rows.get(key)
            if got is not None and got[0] == version:
                del rows[key]
                if got[1][STATE] == OPEN:
                    self._open -= 1
                    released.append(got[1])
        horizon = now - self._settled_ns
        fifo = self._settled
        while fifo and fifo[0][0] <= horizon:
            _, key, version = fifo.popleft()
            got = rows.get(key)
            if got is not None and got[0] == version and got[1][STATE] == SETTLED:
                del rows[key]
        if len(self._admitted) > 2 * len(rows) + COMPACT_SLACK:
            self._compact_admitted()
        horizon = now - self._replay_ns
        fifo = self._rejected
        while fifo and fifo[0][0] <= horizon:
            _, key, version = fifo.popleft()
            got = rows.get(key)
            if got is not None and got[0] == version:
                del rows[key]
        return released

    def _compact_admitted(self) -> None:
        """Drop the admitted FIFO's dead entries (rows settled and forgotten,
        dropped or replaced): with a settled-id window shorter than the TTL
        they would otherwise pile up until the TTL. Runs when at least half
        the FIFO is dead, so its O(n) cost is amortised over the removals
        that made it so. Changes no answer: a dead entry acts on nothing."""
        rows = self._rows
        live = [e for e in self._admitted if (got := rows.get(e[1])) is not None and got[0] == e[2]]
        self._admitted = deque(live)

    def footprint(self) -> dict[str, int]:
        """Sizes of the internal indexes (tests and benchmarks check for leaks).

        ``bytes`` is an estimate, O(n) to compute: the ``sys.getsizeof`` sum of the dict,
        the deques, every key, (version, row) pair and row tuple, every FIFO entry tuple,
        the versions, the request id strings and the row integers outside CPython's
        small-int cache. It leaves out the tenant id strings (shared) and the allocator's
        own overhead."""
        rows = self._rows
        size = sys.getsizeof
        total = size(rows) + sum(map(size, (self._admitted, self._settled, self._rejected)))
        pair = size((0, ())) + size(2**40)  # a (version, row) pair and its version
        for key, (_, row) in rows.items():
            total += size(key) + size(key[2]) + pair + size(row)
            total += sum(size(x) for x in row if not -5 <= x <= 256)
        entry = size((0, (), 0))  # (time, key, version): the three are shared with the rows
        total += entry * (len(self._admitted) + len(self._settled) + len(self._rejected))
        return {
            "rows": len(rows),
            "admitted_fifo": len(self._admitted),
            "settled_fifo": len(self._settled),
            "rejected_fifo": len(self._rejected),
            "bytes": total,
        }

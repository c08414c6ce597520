"""What the plane remembers about each (tenant_id, request_id).

A record is the decision as it was sent plus, for an admitted request, its
open reservation; it is kept until the reservation TTL (admitted requests;
once settled, only for the settled-id window) or the replay window
(refusals) passes. At AdmitStream rates millions are alive at once (rate x
TTL), so the plane keeps them as rows of 64-bit integers in the fast path's
``RequestTable`` (compiled: C memory, no Python object per request; full
collections over millions of per-request objects once paused the server for
seconds, BENCHMARKS.md). Outside the table a record is a plain tuple
(``Record``), built by the two constructors below so the field order lives
in one place; ``RequestLog`` converts between the two.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from controlplane.service.pools import UNKNOWN
from fastpath import RequestTable

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

Key = tuple[str, str]  # (tenant_id, request_id)
Record = tuple[Any, ...]

# Record fields (tuple indexes).
STATE = 0
REASON = 1
RETRY_NS = 2
RESERVED = 3
RID = 4  # reservation id, 0 when refused
GRANTED = 5  # granted max_tokens
BUCKET = 6  # remaining after the decision: bucket tokens, hourly, daily (-1 = unlimited)
HOUR = 7
DAY = 8
LANE = 9
SLOT = 10  # the tenant's fast-path slot, -1 for unknown tenants
DECIDED_NS = 11
POOL = 12
MODEL = 13
MULTIPLIER = 14  # pricing multiplier locked at admission
WINDOW = 15  # pricing window id
ACTUAL = 16  # settlement: actual tokens (-1 while open)
REFUNDED = 17  # settlement: refunded tokens
ARRIVED_NS = 18  # when the Admit reached the plane (before any queueing)
SHADOW_REASON = 19  # shadow mode: the reason it would have been refused for (0 = none)
DEGRADED_CAP = 20  # max_tokens cap when admitted under degradation (0 = not degraded)
SCORE_PPM = 21  # the pool's backpressure score at decision time
FRESHNESS = 22  # the pool view's freshness (pools.FRESH / STALE / UNKNOWN)
SHED = 23  # flags: SHED_BIT, LATE_BIT
FIELDS = 24

# SHED's flags. The lane was held back by backpressure (the pool gate or the
# score); late: the request can no longer meet its deadline (first arrival +
# its lane's TTFT SLO), so a retry of it cannot either (answered retryable
# false; retry_after then says when a fresh request of the lane could).
SHED_BIT = 1
LATE_BIT = 2

# States.
OPEN = 0  # admitted, reservation not settled yet
SETTLED = 1
REJECTED = 2


# The two ways a record is made. Every record in the plane comes from one of
# these (or from ``settled`` below), so the field order lives in one place.
def refused(
    reason: int,
    retry_ns: int,
    lane: str,
    slot: int,
    now: int,
    arrived: int,
    bucket: int = 0,
    hour: int = -1,
    day: int = -1,
    score_ppm: int = 0,
    freshness: int = UNKNOWN,
    shed: int = 0,
) -> Record:
    """A refusal decided at ``now`` for a request that arrived at ``arrived``."""
    return (
        REJECTED, reason, retry_ns, 0, 0, 0, bucket, hour, day, lane, slot, now,
        "", "", 1.0, 0, -1, 0, arrived, 0, 0, score_ppm, freshness, shed,
    )  # fmt: skip


def admitted(
    reserved: int,
    rid: int,
    granted: int,
    bucket: int,
    hour: int,
    day: int,
    lane: str,
    slot: int,
    now: int,
    pool: str,
    model: str,
    multiplier: float,
    window: int,
    arrived: int,
    shadow_reason: int,
    degraded_cap: int,
    score_ppm: int,
    freshness: int,
) -> Record:
    """An open reservation of ``reserved`` tokens (``granted`` of them output)."""
    return (
        OPEN, 0, 0, reserved, rid, granted, bucket, hour, day, lane, slot, now,
        pool, model, multiplier, window, -1, 0, arrived, shadow_reason, degraded_cap,
        score_ppm, freshness, 0,
    )  # fmt: skip


_TRACKER = ("", "")  # a key no name or tenant id has (ids are never empty)


class Names:
    """Lane, pool and model names interned to small integers, the form a
    row of the request table carries them in. Never shrinks: one entry per
    distinct name ever stored (lanes and pools are configured; model names
    come from clients, each distinct one costs its string once)."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {"": 0}
        self.names: list[str] = [""]

    def id(self, name: str) -> int:
        got = self.ids.get(name)
        if got is None:
            got = self.ids[name] = len(self.names)
            self.names.append(name)
        return got


_F64 = struct.Struct("<d")
_I64 = struct.Struct("<q")


def float_bits(x: float) -> int:
    """A float as the signed 64-bit integer of its IEEE-754 bits (how a row holds it)."""
    return int(_I64.unpack(_F64.pack(x))[0])


def bits_float(b: int) -> float:
    return float(_F64.unpack(_I64.pack(b))[0])


# Multipliers are few (one per pool and pricing window): their conversions
# are remembered, up to a bound, rather than redone per record.
_CACHE_MAX = 4096
_BITS: dict[float, int] = {}
_FLOATS: dict[int, float] = {}


def _cached(cache: dict[Any, Any], key: Any, convert: Callable[[Any], Any]) -> Any:
    got = cache.get(key)
    if got is None:
        if len(cache) >= _CACHE_MAX:
            cache.clear()
        got = cache[key] = convert(key)
    return got


class RequestLog:
    """Records by key, stored as rows of the fast path's ``RequestTable``
    (compiled: no Python object per remembered request, so nothing per
    request for the garbage collector to walk; ``fastpath/_reqlog_py.py``
    defines the semantics).

    This class converts: a ``Record`` tuple to a row (lane, pool and model
    interned by ``Names``, the multiplier as its float bits) and back, and a
    ``Key`` (tenant_id, request_id) to the table's key. The table key's
    first part, ``tkey``, separates tenants exactly: a small integer per
    tenant id that has ever been resolved to a tenant (``tkey_for``), never
    reused; -1 for ids that never were (their records are refusals with no
    retry_after, never replayed; such a refusal recorded before its tenant
    was configured is not found afterwards, so a Complete for it answers
    NOT_FOUND instead of FAILED_PRECONDITION).

    An admission is remembered until the reservation TTL; once settled,
    only for ``settled_ns`` after its Complete (and never past the TTL), so
    the memory of a busy plane follows its settlement rate x that window."""

    def __init__(self, ttl_ns: int, replay_ns: int, settled_ns: int | None = None) -> None:
        self.table = RequestTable(ttl_ns, replay_ns, ttl_ns if settled_ns is None else settled_ns)
        self.names = Names()
        self._tkeys: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.table)

    @property
    def open_count(self) -> int:
        return self.table.open_count

    @property
    def remembers_rejections(self) -> bool:
        return self.table.remembers_rejections

    def tkey_for(self, tenant_id: str, resolved: bool) -> int:
        """The table key of ``tenant_id``; ``resolved``: it names (or maps to)
        a tenant now, so it gets its own key if it has none yet."""
        got = self._tkeys.get(tenant_id)
        if got is None:
            if not resolved:
                return -1
            got = self._tkeys[tenant_id] = len(self._tkeys)
        return got

    def prepare_gc_freeze(self) -> None:
        """Nothing per request is GC-tracked (the rows are integers, in C
        memory in the compiled build); the interning dicts are made tracked
        now so that a ``gc.freeze()`` right after moves them out of the
        collector's sight for good (an empty dict is untracked and would
        escape the freeze)."""
        tracked: list[dict[Any, Any]] = [self._tkeys, self.names.ids]
        for d in tracked:
            d[_TRACKER] = []  # a tracked value tracks the dict
            del d[_TRACKER]  # deleting does not untrack it

    # ------------------------------------------------------------ conversions

    def row(self, rec: Record) -> tuple[int, ...]:
        intern = self.names.id
        out = list(rec)
        for f in (LANE, POOL, MODEL):
            out[f] = intern(out[f])
        out[MULTIPLIER] = _cached(_BITS, rec[MULTIPLIER], float_bits)
        return tuple(out)

    def record(self, row: tuple[int, ...]) -> Record:
        names = self.names.names
        out: list[Any] = list(row)
        out[LANE] = names[row[LANE]]
        out[POOL] = names[row[POOL]]
        out[MODEL] = names[row[MODEL]]
        out[MULTIPLIER] = _cached(_FLOATS, row[MULTIPLIER], bits_float)
        return tuple(out)

    # ------------------------------------------------------------------ access

    def get(self, key: Key) -> Record | None:
        row = self.table.get(self._tkeys.get(key[0], -1), key[0], key[1])
        return None if row is None else self.record(row)

    def replay(self, key: Key, now: int) -> Record | None:
        """The earlier decision for ``key`` if it still stands. A refusal
        stands until its retry_after has passed; then the request is decided
        anew (a client backing off with the same id is not refused forever)."""
        row = self.table.replay(self._tkeys.get(key[0], -1), key[0], key[1], now)
        return None if row is None else self.record(row)

    def replay_rows(
        self,
        tkeys: npt.NDArray[np.int64],
        tenant_ids: list[str],
        request_ids: list[str],
        now: int,
    ) -> dict[int, tuple[int, ...]]:
        """``replay`` for a batch, as rows: index -> earlier decision."""
        return self.table.replay_many(tkeys, tenant_ids, request_ids, now)

    def add_admitted(self, key: Key, rec: Record) -> None:
        self.table.add(self.tkey_for(key[0], True), key[0], key[1], self.row(rec))

    def add_rejected(self, key: Key, rec: Record) -> None:
        if self.table.remembers_rejections:
            tkey = self.tkey_for(key[0], rec[SLOT] >= 0)
            self.table.add(tkey, key[0], key[1], self.row(rec))

    def add_rows(
        self,
        tkeys: npt.NDArray[np.int64],
        tenant_ids: list[str],
        request_ids: list[str],
        rows: npt.NDArray[np.int64],
        fresh: npt.NDArray[np.int8] | None,
    ) -> None:
        """Store a batch's fresh decisions (``rows[i]`` where ``fresh[i]``)."""
        self.table.add_batch(tkeys, tenant_ids, request_ids, rows, fresh)

    def settle(self, key: Key, rec: Record, actual: int, refunded: int, now: int) -> Record:
        """``rec`` (open) settled with its real usage and refund."""
        row = self.table.settle(self._tkeys.get(key[0], -1), key[0], key[1], actual, refunded, now)
        return self.record(row)

    def drop_open(self, key: Key) -> Record | None:
        """Forget an admitted, unsettled record (its caller went away before
        learning of it); returns it so the caller can release the slot."""
        row = self.table.drop_open(self._tkeys.get(key[0], -1), key[0], key[1])
        return None if row is None else self.record(row)

    def drop_open_in_pools(self, pools: Sequence[str]) -> list[Record]:
        """Forget the open records of ``pools``; returns them so the caller
        can release their slots."""
        ids = [self.names.ids[p] for p in pools if p in self.names.ids]
        return [self.record(row) for row in self.table.drop_open_where(POOL, ids)]

    def expire(self, now: int) -> list[Record]:
        """Forget records past their window; return the admitted ones whose
        reservation was still open (the caller gives their slot back)."""
        return [self.record(row) for row in self.table.expire(now)]

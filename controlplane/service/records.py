"""What the plane remembers about each (tenant_id, request_id).

A record is the decision as it was sent plus, for an admitted request, its
open reservation; it is kept until the reservation TTL (admitted requests,
settled or not) or the replay window (refusals) passes. At the AdmitStream
rates millions are alive at once (rate x TTL), so a record is a plain tuple
of ints and strings: CPython stops tracking such tuples in the cyclic GC
after the first collection they survive. An instance of a class per record
stays tracked, and full collections over millions of them paused the server
for seconds (BENCHMARKS.md, "AdmitStream").
"""

from __future__ import annotations

from collections import deque
from typing import Any

from controlplane.service.pools import UNKNOWN

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
SHED = 23  # 1 when the lane was held back by backpressure
FIELDS = 24

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


def settled(rec: Record, actual: int, refunded: int) -> Record:
    """``rec`` (open) after its Complete: real usage and the refund."""
    return (SETTLED, *rec[1:ACTUAL], actual, refunded, *rec[REFUNDED + 1 :])


_TRACKER: Key = ("", "")  # a key no request has (ids are never empty)

# Dead keys tolerated in the admitted FIFO beyond twice the open ones.
COMPACT_SLACK = 4096


class RequestLog:
    """Records by key, with O(1) expiry: the TTL, the settled-id window and
    the replay window are constants, so records expire in the order they were
    made (or settled) and a FIFO of (time, keys) per kind is an exact expiry
    queue. A batch adds one FIFO entry for all its keys.

    An admission is remembered until the reservation TTL; once settled, only
    for ``settled_ns`` after its Complete (and never past the TTL), so the
    memory of a busy plane follows its settlement rate x that window."""

    def __init__(self, ttl_ns: int, replay_ns: int, settled_ns: int | None = None) -> None:
        self.records: dict[Key, Record] = {}
        # Entries are tuples of strings and ints, never lists: CPython stops
        # tracking such tuples in the GC, lists it tracks forever.
        self._admitted: deque[tuple[int, tuple[Key, ...]]] = deque()
        self._rejected: deque[tuple[int, tuple[Key, ...]]] = deque()
        self._settled: deque[tuple[int, Key, int]] = deque()  # (settled at, key, decided at)
        self._ttl_ns = ttl_ns
        self._replay_ns = replay_ns
        self._settled_ns = ttl_ns if settled_ns is None else min(settled_ns, ttl_ns)
        self.open_count = 0
        self._admitted_keys = 0  # keys in the admitted FIFO, settled ones included

    def __len__(self) -> int:
        return len(self.records)

    def prepare_gc_freeze(self) -> None:
        """Make the records dict tracked by the garbage collector now, so
        that a ``gc.freeze()`` right after moves it out of the collector's
        sight for good. An empty dict is untracked; it becomes tracked with
        its first tuple key, lands in the young generation and is promoted,
        and then every full collection walks all of its entries (~110 ms
        with a million remembered ids). A frozen dict is never walked, and
        stays frozen whatever it holds later."""
        records = self.records
        records[_TRACKER] = ([],)  # a tracked value (a tuple holding a list) tracks the dict
        del records[_TRACKER]  # deleting does not untrack it

    def replay(self, key: Key, now: int) -> Record | None:
        """The earlier decision for ``key`` if it still stands. A refusal
        stands until its retry_after has passed; then the request is decided
        anew (a client backing off with the same id is not refused forever)."""
        rec = self.records.get(key)
        if rec is not None and rec[STATE] == REJECTED and now >= rec[DECIDED_NS] + rec[RETRY_NS]:
            del self.records[key]
            return None
        return rec

    def replay_many(self, keys: list[Key], now: int) -> dict[int, Record]:
        """``replay`` for a batch: index -> earlier decision, for the keys
        whose decision still stands."""
        records = self.records
        out: dict[int, Record] = {}
        for i, key in enumerate(keys):
            if key in records:
                prior = self.replay(key, now)
                if prior is not None:
                    out[i] = prior
        return out

    @property
    def remembers_rejections(self) -> bool:
        return self._replay_ns > 0

    def add_admitted(self, key: Key, rec: Record) -> None:
        self.records[key] = rec
        self._admitted.append((rec[DECIDED_NS], (key,)))
        self.open_count += 1
        self._admitted_keys += 1

    def add_rejected(self, key: Key, rec: Record) -> None:
        if self._replay_ns > 0:
            self.records[key] = rec
            self._rejected.append((rec[DECIDED_NS], (key,)))

    def add_batch(
        self,
        now: int,
        admitted_keys: list[Key],
        admitted_recs: list[Record],
        rejected_keys: list[Key],
        rejected_recs: list[Record],
    ) -> None:
        """Store a batch's records, all decided at ``now``, with one expiry
        entry per kind for the whole batch."""
        if admitted_keys:
            self.records.update(zip(admitted_keys, admitted_recs, strict=True))
            self._admitted.append((now, tuple(admitted_keys)))
            self.open_count += len(admitted_keys)
            self._admitted_keys += len(admitted_keys)
        if rejected_keys and self._replay_ns > 0:
            self.records.update(zip(rejected_keys, rejected_recs, strict=True))
            self._rejected.append((now, tuple(rejected_keys)))

    def get(self, key: Key) -> Record | None:
        return self.records.get(key)

    def __contains__(self, key: Key) -> bool:
        return key in self.records

    def settle(self, key: Key, rec: Record, actual: int, refunded: int, now: int) -> Record:
        done = settled(rec, actual, refunded)
        self.records[key] = done
        self.open_count -= 1
        if self._settled_ns < self._ttl_ns:  # else the TTL's FIFO forgets it
            self._settled.append((now, key, rec[DECIDED_NS]))
        return done

    def drop_open(self, key: Key) -> Record | None:
        """Forget an admitted, unsettled record (its caller went away before
        learning of it); returns it so the caller can release the slot."""
        rec = self.records.get(key)
        if rec is None or rec[STATE] != OPEN:
            return None
        del self.records[key]
        self.open_count -= 1
        return rec

    def _compact_admitted(self) -> None:
        """Drop the admitted FIFO's entries for keys no longer open under that
        decision (settled, forgotten, re-decided): otherwise a settled id's
        key would stay referenced until the TTL although its record left
        after the settled-id window. Runs when at least half the FIFO is
        dead, so its O(n) cost is amortised over the settlements that made
        it so."""
        records = self.records
        kept: deque[tuple[int, tuple[Key, ...]]] = deque()
        count = 0
        for decided, keys in self._admitted:
            live = tuple(
                k for k in keys
                if (r := records.get(k)) is not None and r[STATE] == OPEN
                and r[DECIDED_NS] == decided
            )  # fmt: skip
            if live:
                kept.append((decided, live))
                count += len(live)
        # in place: the deque itself may be frozen out of the collector's
        # sight (prepare_gc_freeze); a new one would not be
        self._admitted.clear()
        self._admitted.extend(kept)
        self._admitted_keys = count

    def expire(self, now: int) -> list[Record]:
        """Forget records past their window; return the admitted ones whose
        reservation was still open (the caller gives their slot back)."""
        released: list[Record] = []
        records = self.records
        fifo = self._admitted
        horizon = now - self._ttl_ns
        while fifo and fifo[0][0] <= horizon:
            decided, keys = fifo.popleft()
            self._admitted_keys -= len(keys)
            for key in keys:
                rec = records.get(key)
                # The key may since have been re-decided: only drop this decision.
                if rec is not None and rec[DECIDED_NS] == decided and rec[STATE] != REJECTED:
                    del records[key]
                    if rec[STATE] == OPEN:
                        self.open_count -= 1
                        released.append(rec)
        sfifo = self._settled
        horizon = now - self._settled_ns
        while sfifo and sfifo[0][0] <= horizon:
            _, key, decided = sfifo.popleft()
            rec = records.get(key)
            if rec is not None and rec[DECIDED_NS] == decided and rec[STATE] == SETTLED:
                del records[key]
        # (only with a settled-id window: without one the admitted FIFO is
        # what forgets settled records at the TTL)
        if (
            self._settled_ns < self._ttl_ns
            and self._admitted_keys > 2 * self.open_count + COMPACT_SLACK
        ):
            self._compact_admitted()
        rfifo = self._rejected
        horizon = now - self._replay_ns
        while rfifo and rfifo[0][0] <= horizon:
            decided, keys = rfifo.popleft()
            for key in keys:
                rec = records.get(key)
                if rec is not None and rec[DECIDED_NS] == decided and rec[STATE] == REJECTED:
                    del records[key]
        return released

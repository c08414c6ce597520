"""Counters the metrics collector reads at scrape time.

The decision path only bumps plain ints in dicts; turning them into
Prometheus families (tenant labels, the cardinality cap, names) happens at
scrape time, off the path (controlplane/telemetry/tenant_metrics.py).

Counts are kept per tenant *slot* (the fast path's index of a configured
tenant, never reused; -1 for an unknown tenant id), never per tenant id as
sent: an id a client makes up must not grow memory or the metrics, and a
request charged to the default tenant counts as that tenant's.
"""

from __future__ import annotations

import bisect
from collections import Counter

import numpy as np
import numpy.typing as npt

from controlplane.domain import Decision
from controlplane.domain.units import NS_PER_S
from controlplane.service import records as R
from controlplane.service.demand import DemandBook
from controlplane.service.recordview import RecordView
from fastpath import Reason

_OK = int(Reason.OK)
_ADMIT = int(Decision.ADMIT)
_REJECT = int(Decision.REJECT)
_SLOT, _LANE, _REASON, _RESERVED = R.SLOT, R.LANE, R.REASON, R.RESERVED
_SHADOW_REASON, _STATE, _OPEN = R.SHADOW_REASON, R.STATE, R.OPEN

# Queue-wait histogram bounds: around the default lane wait targets
# (200 ms / 800 ms / 5 s).
QUEUE_WAIT_BUCKETS_NS: tuple[int, ...] = tuple(
    int(s * NS_PER_S) for s in (0.001, 0.005, 0.01, 0.05, 0.1, 0.2, 0.5, 0.8, 1, 2, 5, 10, 30)
)

# Reasons per (tenant, lane) cell of the batch path's dense counters.
_REASONS = max(Reason) + 1
_UNSEEN = -(1 << 62)  # a lane name not seen in a batch yet: makes the index negative


class DenseTally:
    """The batch path's counters: decisions and reserved tokens by (tenant
    slot, lane, reason) in two flat int64 arrays, updated with one
    ``np.add.at`` each per batch, whatever the number of tenants in it (a
    dict update per (tenant, lane, reason) group cost ~10x more at 100
    tenants a batch; BENCHMARKS.md). Cell of (slot, lane, reason):
    ``(slot + 1) * stride + lane * _REASONS + reason``, ``lane`` a dense
    index given to each lane the first time a batch carries it.

    Memory: ``stride`` (lanes capacity x 13 reasons) x 16 bytes per tenant
    slot ever configured (832 B with four lanes), grown by doubling."""

    def __init__(self) -> None:
        self.lanes: list[str] = []  # dense index -> lane name
        # interned name id -> (dense lane index) * _REASONS, _UNSEEN if none yet
        self._base = np.zeros(0, dtype=np.int64)
        # (stride, counts, tokens), replaced whole on growth so that a reader
        # on another thread always gets one consistent set
        self.arrays = self._empty(slots=8, lanes=4)

    @staticmethod
    def _empty(slots: int, lanes: int) -> tuple[int, npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        stride = lanes * _REASONS
        size = (slots + 1) * stride
        return stride, np.zeros(size, dtype=np.int64), np.zeros(size, dtype=np.int64)

    def add(self, rows: npt.NDArray[np.int64], lane_names: list[str], slots: int) -> None:
        """Count a batch's rows; ``lane_names`` names the interned ids of
        their LANE column, ``slots`` bounds their SLOT column."""
        base = self._base
        if len(base) < len(lane_names):
            base = self._base = np.concatenate(
                [base, np.full(len(lane_names) - len(base), _UNSEEN, dtype=np.int64)]
            )
        stride, counts, tokens = self.arrays
        if (slots + 1) * stride > len(counts):
            stride, counts, tokens = self._grow(slots, len(self.lanes))
        lanes = base[rows[:, _LANE]]
        if lanes.min() < 0:  # a lane no batch carried before
            for name_id in np.unique(rows[:, _LANE][lanes < 0]).tolist():
                self._learn(int(name_id), lane_names[name_id])
            stride, counts, tokens = self.arrays
            lanes = self._base[rows[:, _LANE]]
        cell = rows[:, _SLOT] * stride
        cell += lanes
        cell += rows[:, _REASON]
        cell += stride  # slot -1 (an unknown tenant) is row 0
        np.add.at(counts, cell, 1)
        np.add.at(tokens, cell, rows[:, _RESERVED])

    def _learn(self, name_id: int, lane: str) -> None:
        stride = self.arrays[0]
        if len(self.lanes) * _REASONS >= stride:
            slots = len(self.arrays[1]) // stride - 1
            self._grow(slots, len(self.lanes) + 1)
        self._base[name_id] = len(self.lanes) * _REASONS
        self.lanes.append(lane)

    def _grow(
        self, slots: int, lanes: int
    ) -> tuple[int, npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Room for ``slots`` tenant slots and ``lanes`` lanes (each at least
        doubled when it grows), the counts so far copied over."""
        old_stride, old_counts, old_tokens = self.arrays
        old_rows = len(old_counts) // old_stride  # slot capacity + 1 (unknown tenants)
        old_lanes = old_stride // _REASONS
        if slots > old_rows - 1:
            slots = max(slots, 2 * (old_rows - 1))
        lanes = old_lanes if lanes <= old_lanes else max(lanes, 2 * old_lanes)
        new = self._empty(max(slots, old_rows - 1), lanes)
        stride, counts, tokens = new
        for old, to in ((old_counts, counts), (old_tokens, tokens)):
            # a cell keeps its place in its row: lane * _REASONS + reason
            to.reshape(-1, stride)[:old_rows, :old_stride] = old.reshape(old_rows, old_stride)
        self.arrays = new
        return new

    def cells(self) -> list[tuple[int, str, int, int, int]]:
        """(slot, lane, reason, decisions, tokens) of every non-empty cell
        (any thread: reads one consistent set of arrays)."""
        stride, counts, tokens = self.arrays
        lanes = list(self.lanes)
        out = []
        for i in np.flatnonzero(counts).tolist():
            row, rest = divmod(i, stride)
            lane, reason = divmod(rest, _REASONS)
            if lane < len(lanes):
                out.append((row - 1, lanes[lane], reason, int(counts[i]), int(tokens[i])))
        return out


Outcome = tuple[int, str, int]  # (slot, lane, reason)


class AdmissionStats:
    def __init__(self) -> None:
        # (slot, lane, reason) -> [decisions, tokens reserved by them]. One
        # dict entry per combination seen, bounded by config (slots, lanes)
        # times the reasons; a refusal reserves 0, so one add covers both.
        self.outcomes: dict[Outcome, list[int]] = {}
        # the same for AdmitStream batches, as dense arrays (DenseTally)
        self.batched = DenseTally()
        # (slot, reason) -> shadow-mode admissions that would have been refused
        self.shadow: Counter[tuple[int, int]] = Counter()
        # (slot, lane) -> [Completes settled, tokens they used]
        self.settled: dict[tuple[int, str], list[int]] = {}
        # (slot, lane, currency) -> [user charge, actual cost], in nanos of
        # the currency, of the records the ledger made durable
        self.spend: dict[tuple[int, str, str], list[int]] = {}
        # lane -> [count per bucket of QUEUE_WAIT_BUCKETS_NS, +Inf], and sums
        self.queue_wait_buckets: dict[str, list[int]] = {}
        self.queue_wait_sum_ns: Counter[str] = Counter()
        self.cancelled_total = 0
        self.offline_booked_total = 0
        self.restored_total = 0  # open reservations re-announced to this replica (restore.py)
        self.expired_total = 0
        # pool -> what users asked of it (service/demand.py)
        self.demand = DemandBook()

    # ------------------------------------------------------- the hot path

    def count(self, rec: R.Record) -> None:
        """One fresh decision (a tuple key, a dict lookup, two additions)."""
        key = (rec[_SLOT], rec[_LANE], rec[_REASON])
        cell = self.outcomes.get(key)
        if cell is None:
            cell = self.outcomes[key] = [0, 0]
        cell[0] += 1
        cell[1] += rec[_RESERVED]
        if rec[_SHADOW_REASON]:
            self.shadow[(key[0], rec[_SHADOW_REASON])] += 1

    def count_rows(
        self, rows: npt.NDArray[np.int64], lane_names: list[str], slots: int, shadow: bool
    ) -> None:
        """A batch's fresh decisions at once, from their request-table rows
        (lanes as interned ids, ``lane_names`` naming them; ``slots``: the
        tenant slots configured, bounding the SLOT column)."""
        if not len(rows):
            return
        self.batched.add(rows, lane_names, slots)
        if shadow:
            would = rows[:, _SHADOW_REASON]
            for i in np.flatnonzero(would).tolist():
                self.shadow[(int(rows[i, _SLOT]), int(would[i]))] += 1

    def count_settled(self, rec: R.Record, actual: int) -> None:
        """A Complete settled ``rec`` with ``actual`` tokens used."""
        key = (rec[_SLOT], rec[_LANE])
        cell = self.settled.get(key)
        if cell is None:
            cell = self.settled[key] = [0, 0]
        cell[0] += 1
        cell[1] += actual

    def count_spend(
        self, rec: RecordView, currency: str, user_charge_nanos: int, actual_cost_nanos: int
    ) -> None:
        """The ledger made a record of ``rec``'s settlement durable (metering)."""
        key = (rec.slot, rec.lane, currency)
        cell = self.spend.get(key)
        if cell is None:
            cell = self.spend[key] = [0, 0]
        cell[0] += user_charge_nanos
        cell[1] += actual_cost_nanos

    def observe_wait(self, lane: str, wait_ns: int) -> None:
        counts = self.queue_wait_buckets.get(lane)
        if counts is None:
            counts = self.queue_wait_buckets[lane] = [0] * (len(QUEUE_WAIT_BUCKETS_NS) + 1)
        counts[bisect.bisect_left(QUEUE_WAIT_BUCKETS_NS, wait_ns)] += 1
        self.queue_wait_sum_ns[lane] += wait_ns

    # ------------------------------------------- totals, computed on demand

    def outcome_cells(self) -> list[tuple[int, str, int, int, int]]:
        """(slot, lane, reason, decisions, tokens reserved) of both paths,
        unary and batch (a key may appear twice: once per path). Any thread."""
        unary = [(k[0], k[1], k[2], c[0], c[1]) for k, c in self.outcomes.copy().items()]
        return unary + self.batched.cells()

    @property
    def decision_counts(self) -> Counter[tuple[int, int]]:
        """(decision, reason) -> decisions, all tenants and lanes."""
        out: Counter[tuple[int, int]] = Counter()
        for _slot, _lane, reason, n, _tokens in self.outcome_cells():
            out[(_ADMIT if reason == _OK else _REJECT, reason)] += n
        return out

    @property
    def shadow_counts(self) -> Counter[int]:
        """reason -> shadow-mode admissions that would have been refused for it."""
        out: Counter[int] = Counter()
        for (_slot, reason), n in self.shadow.copy().items():
            out[reason] += n
        return out

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

# A batch's (slot, lane id, reason) packed into one int64 so that one
# np.unique groups it: slot + 1 (>= 0) above bit 40, the interned lane id
# (< 2**32) above bit 8, the reason (< 256) below.
_LANE_SHIFT = 8
_SLOT_SHIFT = 40
_LOW8 = (1 << _LANE_SHIFT) - 1
_LOW32 = (1 << (_SLOT_SHIFT - _LANE_SHIFT)) - 1

Outcome = tuple[int, str, int]  # (slot, lane, reason)


class AdmissionStats:
    def __init__(self) -> None:
        # (slot, lane, reason) -> [decisions, tokens reserved by them]. One
        # dict entry per combination seen, bounded by config (slots, lanes)
        # times the reasons; a refusal reserves 0, so one add covers both.
        self.outcomes: dict[Outcome, list[int]] = {}
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
        self.expired_total = 0

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

    def count_rows(self, rows: npt.NDArray[np.int64], lane_names: list[str], shadow: bool) -> None:
        """A batch's fresh decisions at once, from their request-table rows
        (lanes as interned ids, ``lane_names`` naming them): grouped with one
        np.unique, then one dict update per (tenant, lane, reason) group,
        a handful per batch whatever its size."""
        if not len(rows):
            return
        slot = rows[:, _SLOT]
        packed = ((slot + 1) << _SLOT_SHIFT) | (rows[:, _LANE] << _LANE_SHIFT) | rows[:, _REASON]
        groups, index = np.unique(packed, return_inverse=True)
        counts = np.bincount(index)
        if len(groups) == 1:
            tokens = [int(rows[:, _RESERVED].sum())]
        else:
            # float64 sums are exact below 2**53 tokens per batch and group
            tokens = np.bincount(index, weights=rows[:, _RESERVED]).astype(np.int64).tolist()
        outcomes = self.outcomes
        for g, n, t in zip(groups.tolist(), counts.tolist(), tokens, strict=True):
            key = ((g >> _SLOT_SHIFT) - 1, lane_names[(g >> _LANE_SHIFT) & _LOW32], g & _LOW8)
            cell = outcomes.get(key)
            if cell is None:
                cell = outcomes[key] = [0, 0]
            cell[0] += n
            cell[1] += t
        if shadow:
            would = rows[:, _SHADOW_REASON]
            some = would != 0
            if some.any():
                packed = ((slot[some] + 1) << _LANE_SHIFT) | would[some]
                groups, counts = np.unique(packed, return_counts=True)
                for g, n in zip(groups.tolist(), counts.tolist(), strict=True):
                    self.shadow[((g >> _LANE_SHIFT) - 1, g & _LOW8)] += n

    def count_settled(self, rec: R.Record, actual: int) -> None:
        """A Complete settled ``rec`` with ``actual`` tokens used."""
        key = (rec[_SLOT], rec[_LANE])
        cell = self.settled.get(key)
        if cell is None:
            cell = self.settled[key] = [0, 0]
        cell[0] += 1
        cell[1] += actual

    def count_spend(
        self, rec: R.Record, currency: str, user_charge_nanos: int, actual_cost_nanos: int
    ) -> None:
        """The ledger made a record of ``rec``'s settlement durable (metering)."""
        key = (rec[_SLOT], rec[_LANE], currency)
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

    @property
    def decision_counts(self) -> Counter[tuple[int, int]]:
        """(decision, reason) -> decisions, all tenants and lanes."""
        out: Counter[tuple[int, int]] = Counter()
        for (_slot, _lane, reason), cell in self.outcomes.copy().items():
            out[(_ADMIT if reason == _OK else _REJECT, reason)] += cell[0]
        return out

    @property
    def shadow_counts(self) -> Counter[int]:
        """reason -> shadow-mode admissions that would have been refused for it."""
        out: Counter[int] = Counter()
        for (_slot, reason), n in self.shadow.copy().items():
            out[reason] += n
        return out

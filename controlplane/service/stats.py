"""Counters the metrics collector reads at scrape time.

The decision path only bumps plain ints in dicts; turning them into
Prometheus families happens at scrape time, off the path.
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

# Queue-wait histogram bounds: around the default lane wait targets
# (200 ms / 800 ms / 5 s).
QUEUE_WAIT_BUCKETS_NS: tuple[int, ...] = tuple(
    int(s * NS_PER_S) for s in (0.001, 0.005, 0.01, 0.05, 0.1, 0.2, 0.5, 0.8, 1, 2, 5, 10, 30)
)


class AdmissionStats:
    def __init__(self) -> None:
        # (decision, reason) -> count
        self.decision_counts: Counter[tuple[int, int]] = Counter()
        # reason a shadow-mode admission would have been refused for -> count
        self.shadow_counts: Counter[int] = Counter()
        # lane -> [count per bucket of QUEUE_WAIT_BUCKETS_NS, +Inf], and sums
        self.queue_wait_buckets: dict[str, list[int]] = {}
        self.queue_wait_sum_ns: Counter[str] = Counter()
        self.cancelled_total = 0
        self.expired_total = 0

    def count(self, rec: R.Record) -> None:
        reason = rec[R.REASON]
        self.decision_counts[(_ADMIT if reason == _OK else _REJECT, reason)] += 1
        if rec[R.SHADOW_REASON]:
            self.shadow_counts[rec[R.SHADOW_REASON]] += 1

    def count_reason_columns(
        self, reasons: npt.NDArray[np.int64], shadow_reasons: npt.NDArray[np.int64] | None
    ) -> None:
        """A batch's fresh decisions at once, as columns."""
        counts = np.bincount(reasons)
        for reason in np.flatnonzero(counts).tolist():
            self.decision_counts[(_ADMIT if reason == _OK else _REJECT, reason)] += int(
                counts[reason]
            )
        if shadow_reasons is not None and shadow_reasons.any():
            counts = np.bincount(shadow_reasons)
            for would in np.flatnonzero(counts[1:]).tolist():
                self.shadow_counts[would + 1] += int(counts[would + 1])

    def observe_wait(self, lane: str, wait_ns: int) -> None:
        counts = self.queue_wait_buckets.get(lane)
        if counts is None:
            counts = self.queue_wait_buckets[lane] = [0] * (len(QUEUE_WAIT_BUCKETS_NS) + 1)
        counts[bisect.bisect_left(QUEUE_WAIT_BUCKETS_NS, wait_ns)] += 1
        self.queue_wait_sum_ns[lane] += wait_ns

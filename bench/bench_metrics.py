"""What the per-tenant metrics cost the decision path, side by side in one run.

    .venv/bin/python bench/bench_metrics.py [--rounds 9] [--n 20000]

Runs bench_service.py's scenarios (the service's public API, no gRPC, a
fake clock, 100 tenants) in two variants, alternating round by round in
one process, and prints the median ns per decision of each:

* "per tenant": the service as shipped (controlplane/service/stats.py:
  a dict entry per (tenant, lane, reason) for a unary decision, two
  ``np.add.at`` per AdmitStream batch, the settled tokens per Complete);
* "before": ``AdmissionStats`` patched back to the counting it had before
  the per-tenant metrics (one Counter entry per (decision, reason), one
  ``np.bincount`` per batch, nothing per Complete).

Everything else is the same code, so the difference is the counting. On a
shared machine the rounds spread by more than that difference; the
load-independent figure is callgrind's (BENCHMARKS.md has both). Nothing
here asserts a time.
"""

from __future__ import annotations

import argparse
import gc
import statistics
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
from bench_service import batch, unary, waiting

from controlplane.domain import Decision
from controlplane.service import records as R
from controlplane.service.stats import AdmissionStats
from fastpath import Reason

_OK, _ADMIT, _REJECT = int(Reason.OK), int(Decision.ADMIT), int(Decision.REJECT)
_old_decisions: Counter[tuple[int, int]] = Counter()
_old_shadow: Counter[int] = Counter()


def _old_count(self: AdmissionStats, rec: R.Record) -> None:
    reason = rec[R.REASON]
    _old_decisions[(_ADMIT if reason == _OK else _REJECT, reason)] += 1
    if rec[R.SHADOW_REASON]:
        _old_shadow[rec[R.SHADOW_REASON]] += 1


def _old_count_rows(
    self: AdmissionStats, rows: Any, lane_names: list[str], slots: int, shadow: bool
) -> None:
    counts = np.bincount(rows[:, R.REASON])
    for reason in np.flatnonzero(counts).tolist():
        _old_decisions[(_ADMIT if reason == _OK else _REJECT, reason)] += int(counts[reason])


def _old_count_settled(self: AdmissionStats, rec: R.Record, actual: int) -> None:
    return None


@contextmanager
def counting(variant: str) -> Iterator[None]:
    saved = {
        name: getattr(AdmissionStats, name) for name in ("count", "count_rows", "count_settled")
    }
    if variant == "before":
        AdmissionStats.count = _old_count  # type: ignore[method-assign]
        AdmissionStats.count_rows = _old_count_rows  # type: ignore[method-assign]
        AdmissionStats.count_settled = _old_count_settled  # type: ignore[method-assign]
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(AdmissionStats, name, fn)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--n", type=int, default=20_000, help="decisions per scenario and round")
    args = ap.parse_args()
    n = args.n
    scenarios: dict[str, Callable[[], float]] = {
        "admit+complete": lambda: unary(n, True),
        "admit_or_wait (backlog)": lambda: waiting(n),
        "admit_batch 100": lambda: batch(n, 100, True),
        "admit_batch 1000": lambda: batch(n, 1000, True),
        "admit_batch 100, 4 tenants": lambda: batch(n, 100, True, 4),
        "admit_batch 1000, 4 tenants": lambda: batch(n, 1000, True, 4),
    }
    variants = ("before", "per tenant")
    results: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        for name, run in scenarios.items():
            order = variants if r % 2 == 0 else variants[::-1]
            for variant in order:
                gc.collect()
                with counting(variant):
                    results.setdefault((name, variant), []).append(run())
    print("| scenario | before, ns/decision | per tenant | per tenant / before |")
    print("|---|---:|---:|---:|")
    for name in scenarios:
        old = statistics.median(results[(name, "before")])
        new = statistics.median(results[(name, "per tenant")])
        print(f"| {name} | {old:,.0f} | {new:,.0f} | {new / old:.2f}x |")


if __name__ == "__main__":
    main()

"""Pricing steps and stored pricing windows: the pure data of dynamic
cost-aware pricing (the windows themselves are ``controlplane.ledger.pricing``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal

from controlplane.domain.units import PPM

BASE_MULTIPLIER = Decimal(1)


class StepTable:
    """``[(threshold, multiplier), ...]`` ascending: a measured miss rate
    strictly above a threshold sets its multiplier (the highest one matched
    wins); below every threshold the base multiplier 1 applies."""

    def __init__(self, steps: Sequence[tuple[Decimal, Decimal]]) -> None:
        thresholds = [t for t, _ in steps]
        if thresholds != sorted(set(thresholds)):
            raise ValueError("pricing steps: thresholds must be strictly ascending")
        for t, m in steps:
            if not (Decimal(0) <= t < 1):
                raise ValueError(f"pricing steps: threshold {t} must be in [0, 1)")
            if m <= 0:
                raise ValueError(f"pricing steps: multiplier {m} must be > 0")
        self.steps = [(int(t * PPM), m) for t, m in steps]
        self.decimals = {float(m): m for _, m in steps} | {1.0: BASE_MULTIPLIER}

    def multiplier(self, rate_ppm: int | None) -> Decimal:
        chosen = BASE_MULTIPLIER
        if rate_ppm is None:
            return chosen
        for threshold, m in self.steps:
            if rate_ppm > threshold:
                chosen = m
        return chosen


@dataclass(frozen=True, slots=True)
class WindowSummary:
    """A (pool, model) window as stored in ``pricing_windows``."""

    pool: str
    model: str
    window_start_s: int
    window_s: int
    completions: int
    completion_weight: int
    completion_weighted_ppm: int
    load_reports: int
    load_ppm_sum: int
    miss_rate_ppm: int | None  # the measured rate (completions, else load reports)
    multiplier: Decimal  # in force during this window
    next_multiplier: Decimal  # what this window's rate sets for the next one
    closed: bool

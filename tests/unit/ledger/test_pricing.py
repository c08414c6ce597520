"""Pricing windows with an injected clock: the multiplier in force during
window k comes from window k-1's measured cache-miss rate."""

from __future__ import annotations

from decimal import Decimal

import pytest

from controlplane.domain.pricing import StepTable
from controlplane.ledger.pricing import PricingBook

S = 1_000_000_000
W = 300 * S
T0 = 5_666_666 * W  # a window boundary


def book() -> PricingBook:
    return PricingBook(300, StepTable([(Decimal("0.30"), Decimal("1.20")),
                                       (Decimal("0.60"), Decimal("1.50"))]))  # fmt: skip


def test_switches_exactly_at_the_boundary_and_one_price_per_window() -> None:
    b = book()
    assert b.quote("p", "m", T0).multiplier == 1.0
    b.observe_completion("p", "m", 1000, 400_000, T0 + 10 * S)  # 0.40 in window k
    assert b.quote("p", "m", T0 + W - 1).multiplier == 1.0  # still window k
    q = b.quote("p", "m", T0 + W)
    assert q.multiplier == 1.2 and q.window_id == (T0 + W) // S
    # traffic in window k+1 does not move k+1's price
    b.observe_completion("p", "m", 1000, 900_000, T0 + W + S)
    assert b.quote("p", "m", T0 + 2 * W - 1).multiplier == 1.2
    assert b.quote("p", "m", T0 + 2 * W).multiplier == 1.5  # set by k+1's 0.90
    assert b.quote("p", "m", T0 + 3 * W).multiplier == 1.0  # k+2 measured nothing


def test_rate_is_prompt_weighted_and_threshold_is_strict() -> None:
    b = book()
    b.quote("p", "m", T0)
    b.observe_completion("p", "m", 3000, 100_000, T0)  # 0.1 on 3,000 tokens
    b.observe_completion("p", "m", 1000, 900_000, T0)  # 0.9 on 1,000 tokens -> 0.30
    assert b.quote("p", "m", T0 + W).multiplier == 1.0  # 0.30 is not above 0.30


def test_load_reports_set_the_rate_for_models_without_reporting_completions() -> None:
    b = book()
    b.observe_load("p", 0.5, T0)
    b.observe_load("p", 0.3, T0 + S)
    assert b.quote("p", "any-model", T0 + W).multiplier == 1.2  # mean 0.40
    assert b.current_rate_ppm("p", "any-model", T0 + W) == 400_000  # previous window's


def test_windows_are_summarised_and_restored() -> None:
    b = book()
    b.quote("p", "m", T0)
    b.observe_completion("p", "m", 10, 700_000, T0)
    rows = b.snapshot(T0 + W)
    closed = [r for r in rows if r.closed]
    assert closed[0].miss_rate_ppm == 700_000 and closed[0].next_multiplier == Decimal("1.50")
    fresh = book()
    fresh.restore(closed)
    assert fresh.quote("p", "m", T0 + W).multiplier == 1.5  # after a restart


def test_step_table_is_validated() -> None:
    with pytest.raises(ValueError, match="ascending"):
        StepTable([(Decimal("0.5"), Decimal(2)), (Decimal("0.3"), Decimal(1))])
    with pytest.raises(ValueError, match="threshold"):
        StepTable([(Decimal("1.5"), Decimal(2))])

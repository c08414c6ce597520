"""The base charge (the user charge at multiplier 1) per record: exact
half-to-even rounding in integers, against Decimal arithmetic; the sums'
derived figures."""

from __future__ import annotations

from decimal import ROUND_HALF_EVEN, Decimal

from hypothesis import given
from hypothesis import strategies as st

from controlplane.ledger.revenue import Sums, base_charge_nanos, multiplier_micro


def _decimal_base(user_nanos: int, micro: int) -> int:
    return int((Decimal(user_nanos) * 1_000_000 / Decimal(micro)).to_integral_value(
        rounding=ROUND_HALF_EVEN))  # fmt: skip


@given(st.integers(0, 2**63 - 1), st.integers(1, 999_999_999))
def test_base_charge_is_the_charge_over_the_multiplier_half_to_even(user: int, micro: int) -> None:
    assert base_charge_nanos(user, micro) == _decimal_base(user, micro)


def test_ties_round_to_even_and_multiplier_one_is_the_charge_itself() -> None:
    # 3 / 2 = 1.5 -> 2; 5 / 2 = 2.5 -> 2; 7 / 2 = 3.5 -> 4 (multiplier 2)
    assert [base_charge_nanos(u, 2_000_000) for u in (3, 5, 7)] == [2, 2, 4]
    assert base_charge_nanos(123_456_789, 1_000_000) == 123_456_789
    assert base_charge_nanos(1_200_000, 1_200_000) == 1_000_000


def test_stored_multipliers_to_millionths() -> None:
    # PostgreSQL gives Decimal('1.200000'); SQLite's text of a REAL is '1.2'
    # and of an integral value '1'.
    assert [multiplier_micro(v) for v in (Decimal("1.200000"), "1.2", "1", 1.15, "0.000001")] == [
        1_200_000, 1_200_000, 1_000_000, 1_150_000, 1,
    ]  # fmt: skip


def test_sums_margin_and_mean_multiplier() -> None:
    s = Sums()
    s.add(100, 10, 20, 1_200, 600, 1_200_000)  # base 1,000
    s.add(100, 0, 20, 3_000, 900, 1_000_000)  # base 3,000
    assert (s.requests, s.tokens, s.base_charge_nanos, s.dynamic_revenue_nanos) == (
        2, 240, 4_000, 200,
    )  # fmt: skip
    assert s.gross_margin_nanos == 2_700 and s.margin_percent() == Decimal("64.29")
    # weighted by base charge: (1.2 x 1000 + 1 x 3000) / 4000 = 1.05
    assert s.mean_multiplier() == Decimal("1.050000")
    free = Sums()
    free.add(1, 0, 1, 0, 5, 1_200_000)
    free.add(1, 0, 1, 0, 5, 1_000_000)
    assert free.margin_percent() is None and free.mean_multiplier() == Decimal("1.100000")
    assert Sums().mean_multiplier() is None

"""The ledger formulas, exact decimal money and the catalog's precedence."""

from __future__ import annotations

from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.domain.catalog import (
    PriceCatalog,
    PriceEntry,
    actual_cost,
    parse_lane_multipliers,
    user_charge,
    validate_entry,
)
from controlplane.domain.errors import InvalidArgument
from controlplane.domain.money import (
    format_multiplier,
    format_nanos,
    multiplier_decimal,
    parse_decimal,
    to_nanos,
)


def entry(tenant: str = "*", model: str = "*", **kw: str) -> PriceEntry:
    prices = {
        "input_per_mtok": "3",
        "cached_input_per_mtok": "0.3",
        "output_per_mtok": "15",
        "gpu_prefill_per_mtok": "1",
        "gpu_decode_per_mtok": "5",
        "gpu_overhead_per_request": "0.00002",
    } | kw
    d = {k: Decimal(v) for k, v in prices.items()}
    return PriceEntry(
        tenant, model, "USD", d["input_per_mtok"], d["cached_input_per_mtok"],
        d["output_per_mtok"], d["gpu_prefill_per_mtok"], d["gpu_decode_per_mtok"],
        d["gpu_overhead_per_request"],
    )  # fmt: skip


def test_cached_tokens_are_billed_at_the_cached_price() -> None:
    p = entry()
    one = Decimal(1)
    # 1,000 prompt tokens of which 800 cached: 200 x 3 + 800 x 0.3 + 500 x 15, per million
    assert user_charge(p, 1000, 800, 500, one, one) == Decimal("0.00834")
    assert user_charge(p, 1000, 0, 500, one, one) == Decimal("0.0105")


def test_multipliers_apply_to_the_user_charge_only() -> None:
    p = entry()
    base = user_charge(p, 1000, 0, 0, Decimal(1), Decimal(1))
    assert user_charge(p, 1000, 0, 0, Decimal("1.2"), Decimal("1.5")) == base * Decimal("1.8")
    # cost: prompt x (1 + miss x 0.5) x prefill + output x decode, per million, + overhead
    assert actual_cost(p, 1000, 200, Decimal("0.4")) == Decimal("0.00222")


def test_rounding_is_half_even_at_nano_units_and_formatting_is_fixed() -> None:
    assert to_nanos(Decimal("0.0000000005")) == 0
    assert to_nanos(Decimal("0.0000000015")) == 2
    assert to_nanos(Decimal("1.23456789049")) == 1_234_567_890
    assert format_nanos(1_234_567_890) == "1.234567890"
    assert format_nanos(5) == "0.000000005"
    assert format_nanos(-5) == "-0.000000005"
    assert multiplier_decimal(1.2) == Decimal("1.2")
    # The API's text for a multiplier: the ledger's 6 places, never a float's digits.
    assert format_multiplier(1.2) == "1.200000"
    assert format_multiplier(1.0) == "1.000000"
    assert format_multiplier(0.1 + 0.2) == "0.300000"


@given(
    st.integers(0, 10_000_000), st.integers(0, 10_000_000), st.integers(0, 10_000_000),
    st.decimals(0, 999, places=6), st.decimals("0.000001", 100, places=6),
)  # fmt: skip
def test_user_charge_is_exact(p: int, c: int, o: int, price: Decimal, mult: Decimal) -> None:
    c = min(c, p)
    e = entry(input_per_mtok=str(price), cached_input_per_mtok=str(price / 2),
              output_per_mtok=str(price * 3))  # fmt: skip
    got = user_charge(e, p, c, o, mult, Decimal(1))
    expect = (Decimal(p - c) * e.input_per_mtok + Decimal(c) * e.cached_input_per_mtok
              + Decimal(o) * e.output_per_mtok) * mult / Decimal(10**6)  # fmt: skip
    assert got == expect.normalize() or got == expect


def test_catalog_precedence() -> None:
    cat = PriceCatalog([entry(), entry("acme"), entry("*", "big"), entry("acme", "big")])
    assert cat.resolve("acme", "big") == entry("acme", "big")
    assert cat.resolve("acme", "small") == entry("acme")
    assert cat.resolve("beta", "big") == entry("*", "big")
    assert cat.resolve("beta", "small") == entry()
    assert PriceCatalog().resolve("x", "y") is None


def test_validation_names_the_field() -> None:
    with pytest.raises(InvalidArgument, match="currency"):
        validate_entry(PriceEntry("a", "*", "usd", *(Decimal(0),) * 6))
    with pytest.raises(InvalidArgument, match="at most 9 decimal places"):
        parse_decimal("input", "0.0000000001", decimals=9, maximum=Decimal(10**6))
    with pytest.raises(InvalidArgument, match="input"):
        parse_decimal("input", "-1", decimals=9, maximum=Decimal(10**6))
    with pytest.raises(InvalidArgument, match="input"):
        parse_decimal("input", "NaN", decimals=9, maximum=Decimal(10**6))
    assert parse_lane_multipliers(["premium=1.5"]) == {"premium": Decimal("1.5")}
    with pytest.raises(InvalidArgument, match="lane_multipliers"):
        parse_lane_multipliers(["premium"])
    with pytest.raises(InvalidArgument, match="lane_multipliers"):
        parse_lane_multipliers(["premium=0"])

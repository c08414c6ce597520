"""Reason numbering, units and the int64 headroom the limits promise."""

from __future__ import annotations

from types import ModuleType

import fastpath
from fastpath import codes
from fastpath.codes import Reason

I64_MAX = 2**63 - 1


def test_reason_numbering_is_fixed() -> None:
    assert {r.name: r.value for r in Reason} == {
        "OK": 0,
        "TOKEN_RATE": 1,
        "HOURLY_QUOTA": 2,
        "DAILY_QUOTA": 3,
        "CONCURRENCY": 4,
        "MAX_TOKENS": 5,
        "UNKNOWN_TENANT": 6,
        "TENANT_DISABLED": 7,
    }
    assert fastpath.Reason is Reason


def test_units() -> None:
    assert codes.NS_PER_S == 10**9
    assert codes.NS_PER_HOUR == 3_600 * 10**9
    assert codes.NS_PER_DAY == 24 * codes.NS_PER_HOUR
    assert codes.MTOK_PER_TOKEN == 1_000


def test_limits_keep_every_product_in_int64() -> None:
    max_burst, max_rate = codes.MAX_BURST_MTOK, codes.MAX_RATE_MTOK_PER_S
    # Refill: rate * sub-second ns + remainder.
    assert max_rate * (codes.NS_PER_S - 1) + codes.NS_PER_S <= I64_MAX
    # Refill: whole seconds are only multiplied while below (burst - level) // rate + 1.
    assert 2 * max_burst + max_rate <= I64_MAX
    # Wait: m * 1e9 with m < rate, and deficits up to 2 * burst.
    assert max_rate * codes.NS_PER_S <= I64_MAX
    # Request costs in mtok, and the debt floor.
    assert max_burst >= 2 * codes.MAX_REQUEST_TOKENS * codes.MTOK_PER_TOKEN
    # Next-window start from any accepted now.
    assert codes.MAX_NOW_NS + codes.NS_PER_DAY <= I64_MAX
    assert codes.RETRY_AFTER_NS_MAX == I64_MAX


def test_compiled_constants_match_codes(both: tuple[ModuleType, ModuleType]) -> None:
    _, compiled = both
    expected = {
        name: getattr(codes, name)
        for name in (
            "NS_PER_S", "NS_PER_HOUR", "NS_PER_DAY", "MTOK_PER_TOKEN", "MAX_RATE_MTOK_PER_S",
            "MAX_BURST_MTOK", "MAX_REQUEST_TOKENS", "MAX_NOW_NS", "MAX_SLOTS",
            "RETRY_AFTER_NS_MAX",
        )
    } | {r.name: r.value for r in Reason if r <= Reason.MAX_TOKENS}  # fmt: skip
    assert compiled._c_constants() == expected

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
        "GLOBAL_WATERMARK": 8,
        "BACKPRESSURE": 9,
        "QUEUE_TIMEOUT": 10,
        "QUEUE_FULL": 11,
        "OPEN_RESERVATIONS": 12,
        "NOT_OWNER": 13,
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
    # Shadow charges: a level >= -burst minus a whole request, before the debt floor.
    assert -max_burst - codes.MAX_REQUEST_TOKENS * codes.MTOK_PER_TOKEN >= -(2**63)
    # Global watermark: the check forms limit - total (total in [0, 2**63)), never
    # total + cost; the cap is a sanity bound far above any single request.
    assert 0 - I64_MAX >= -(2**63)
    assert codes.MAX_GLOBAL_INFLIGHT_TOKENS <= I64_MAX
    assert codes.MAX_GLOBAL_INFLIGHT_TOKENS >= 10**6 * codes.MAX_REQUEST_TOKENS


def test_scheduling_limits_keep_every_product_in_int64() -> None:
    ppm = codes.PPM
    assert ppm == 1_000_000
    # Backpressure ratios: min(x, cap) * PPM, then weight * ratio summed.
    assert codes.MAX_BACKPRESSURE_CAPACITY * ppm <= I64_MAX
    assert 3 * ppm * ppm <= I64_MAX
    # Drain wait: (score - target) * 1e9.
    assert ppm * codes.NS_PER_S <= I64_MAX
    # Shed thresholds: (hard - soft) * rank with rank < sheddable <= MAX_FLOWS.
    assert ppm * codes.MAX_FLOWS <= I64_MAX
    # Fair queue: one charge adds at most (2 * MAX_REQUEST_TOKENS * PPM + rem) // 1 to a vt
    # of at most VT_MAX (renormalize_above <= VT_MAX), and vt - floor stays >= -VT_MAX.
    biggest_charge = 2 * codes.MAX_REQUEST_TOKENS * ppm + ppm
    assert codes.VT_MAX + biggest_charge <= I64_MAX
    assert codes.VT_MAX + biggest_charge < 2**62


def test_compiled_constants_match_codes(both: tuple[ModuleType, ModuleType]) -> None:
    _, compiled = both
    names = (
        "NS_PER_S", "NS_PER_HOUR", "NS_PER_DAY", "MTOK_PER_TOKEN", "MAX_RATE_MTOK_PER_S",
        "MAX_BURST_MTOK", "MAX_REQUEST_TOKENS", "MAX_NOW_NS", "MAX_SLOTS",
        "RETRY_AFTER_NS_MAX", "MAX_GLOBAL_INFLIGHT_TOKENS", "MAX_USAGE_TOKENS",
    )  # fmt: skip
    produced = [
        r
        for r in Reason
        if r <= Reason.MAX_TOKENS or r in (Reason.GLOBAL_WATERMARK, Reason.OPEN_RESERVATIONS)
    ]
    expected = {name: getattr(codes, name) for name in names} | {r.name: r.value for r in produced}
    assert compiled._c_constants() == expected


def test_compiled_sched_constants_match_codes(sched_both: tuple[ModuleType, ModuleType]) -> None:
    _, compiled = sched_both
    names = ("NS_PER_S", "PPM", "MAX_REQUEST_TOKENS", "MAX_BACKPRESSURE_CAPACITY", "MAX_FLOWS",
             "VT_MAX")  # fmt: skip
    assert compiled._c_constants() == {name: getattr(codes, name) for name in names}

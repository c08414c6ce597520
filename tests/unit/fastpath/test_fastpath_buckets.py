"""Hand-computed behaviour of TokenBucketTable, run against both builds (``impl``)."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from fastpath.codes import (
    MAX_BURST_MTOK,
    MAX_GLOBAL_INFLIGHT_TOKENS,
    MAX_NOW_NS,
    MAX_RATE_MTOK_PER_S,
    MAX_REQUEST_TOKENS,
    MAX_SLOTS,
    NS_PER_DAY,
    NS_PER_HOUR,
    NS_PER_S,
    RETRY_AFTER_NS_MAX,
    Reason,
)

T0 = 20_000 * NS_PER_DAY  # a UTC midnight (2024-10-04), so window starts are easy to see
MIN = 60 * NS_PER_S

OK = Reason.OK
TOKEN_RATE = Reason.TOKEN_RATE
HOURLY = Reason.HOURLY_QUOTA
DAILY = Reason.DAILY_QUOTA
CONC = Reason.CONCURRENCY
MAX_TOKENS = Reason.MAX_TOKENS


def make(
    impl: ModuleType,
    *,
    slot: int = 0,
    now: int = T0,
    rate: int = 1_000,
    burst: int = 100_000,
    hourly: int = 0,
    daily: int = 0,
    conc: int = 0,
    per_request: int = 0,
    capacity: int = 4,
) -> Any:
    table = impl.TokenBucketTable(capacity)
    table.configure(slot, now, rate, burst, hourly, daily, conc, per_request)
    return table


# --- configure ---------------------------------------------------------------------


def test_new_slot_starts_full(impl: ModuleType) -> None:
    table = make(impl, now=T0 + 5 * MIN, rate=7, burst=12_345)
    assert table.is_configured(0)
    assert table.snapshot(0) == {
        "rate_mtok_per_s": 7,
        "burst_mtok": 12_345,
        "hourly_quota": 0,
        "daily_quota": 0,
        "max_concurrency": 0,
        "max_tokens_per_request": 0,
        "level_mtok": 12_345,
        "rem": 0,
        "last_ns": T0 + 5 * MIN,
        "hour_idx": (T0 + 5 * MIN) // NS_PER_HOUR,
        "hour_used": 0,
        "day_idx": T0 // NS_PER_DAY,
        "day_used": 0,
        "inflight": 0,
        "inflight_tokens": 0,
    }
    assert table.level_mtok(0, T0 + 10 * MIN) == 12_345


@pytest.mark.parametrize(
    ("args", "name"),
    [
        ({"slot": -1}, "slot"),
        ({"slot": MAX_SLOTS}, "slot"),
        ({"now": -1}, "now_ns"),
        ({"now": MAX_NOW_NS + 1}, "now_ns"),
        ({"rate": 0}, "rate_mtok_per_s"),
        ({"rate": MAX_RATE_MTOK_PER_S + 1}, "rate_mtok_per_s"),
        ({"burst": 999}, "burst_mtok"),
        ({"burst": MAX_BURST_MTOK + 1}, "burst_mtok"),
        ({"hourly": -1}, "hourly_quota"),
        ({"daily": -1}, "daily_quota"),
        ({"conc": -1}, "max_concurrency"),
        ({"per_request": -1}, "max_tokens_per_request"),
        ({"per_request": MAX_REQUEST_TOKENS + 1}, "max_tokens_per_request"),
    ],
)
def test_configure_rejects_bad_values_by_name(
    impl: ModuleType, args: dict[str, int], name: str
) -> None:
    params = {
        "slot": 0, "now": T0, "rate": 1_000, "burst": 1_000, "hourly": 0, "daily": 0,
        "conc": 0, "per_request": 0,
    } | args  # fmt: skip
    table = impl.TokenBucketTable(4)
    with pytest.raises(ValueError, match=name):
        table.configure(*params.values())
    assert not table.is_configured(params["slot"])


def test_configure_accepts_the_limits(impl: ModuleType) -> None:
    table = impl.TokenBucketTable(1)
    table.configure(MAX_SLOTS - 1, MAX_NOW_NS, MAX_RATE_MTOK_PER_S, MAX_BURST_MTOK, 2**63 - 1,
                    2**63 - 1, 2**63 - 1, MAX_REQUEST_TOKENS)  # fmt: skip
    table.configure(0, 0, 1, 1_000, 0, 0, 0, 0)
    assert table.capacity == MAX_SLOTS
    assert table.level_mtok(MAX_SLOTS - 1, MAX_NOW_NS) == MAX_BURST_MTOK


def test_table_grows_when_a_slot_past_capacity_is_configured(impl: ModuleType) -> None:
    table = make(impl, capacity=2, slot=1, burst=5_000)
    assert table.capacity == 2
    table.configure(2, T0, 1_000, 9_000, 0, 0, 0, 0)  # doubles
    assert table.capacity == 4
    table.configure(100, T0, 1_000, 7_000, 0, 0, 0, 0)  # jumps straight to slot + 1
    assert table.capacity == 101
    assert [table.is_configured(s) for s in (0, 1, 2, 3, 99, 100, 101, -1)] == [
        False, True, True, False, False, True, False, False,
    ]  # fmt: skip
    assert table.level_mtok(1, T0) == 5_000  # old slots survive the realloc
    assert table.level_mtok(2, T0) == 9_000
    assert table.level_mtok(100, T0) == 7_000


@pytest.mark.parametrize("capacity", [0, -1, MAX_SLOTS + 1])
def test_bad_capacity(impl: ModuleType, capacity: int) -> None:
    with pytest.raises(ValueError, match="capacity"):
        impl.TokenBucketTable(capacity)


def test_reconfigure_keeps_level_refilled_at_old_rate(impl: ModuleType) -> None:
    table = make(impl, rate=1_000, burst=100_000, hourly=500, daily=900, conc=3)
    assert table.admit(0, T0, 40, 40)[0] == OK  # level 100_000 - 80_000 = 20_000
    # 10 s later, at the OLD rate of 1 token/s: 30_000; the new burst 25_000 clamps it.
    table.configure(0, T0 + 10 * NS_PER_S, 5_000, 25_000, 600, 1_000, 2, 50)
    snap = table.snapshot(0)
    assert snap["level_mtok"] == 25_000
    assert snap["rem"] == 0
    assert snap["last_ns"] == T0 + 10 * NS_PER_S
    assert (snap["hour_used"], snap["day_used"], snap["inflight"], snap["inflight_tokens"]) == (
        80, 80, 1, 80,
    )  # fmt: skip
    assert (snap["rate_mtok_per_s"], snap["burst_mtok"], snap["hourly_quota"]) == (
        5_000, 25_000, 600,
    )  # fmt: skip
    assert (snap["daily_quota"], snap["max_concurrency"], snap["max_tokens_per_request"]) == (
        1_000, 2, 50,
    )  # fmt: skip
    assert table.total_inflight_tokens() == 80


def test_reconfigure_below_burst_keeps_level_and_uses_new_rate(impl: ModuleType) -> None:
    table = make(impl, rate=1_000, burst=100_000)
    table.admit(0, T0, 90, 0)  # 10_000 left
    table.configure(0, T0 + 2 * NS_PER_S, 4_000, 200_000, 0, 0, 0, 0)  # 12_000 at old rate
    assert table.level_mtok(0, T0 + 2 * NS_PER_S) == 12_000
    assert table.level_mtok(0, T0 + 3 * NS_PER_S) == 16_000  # new rate from then on


def test_reconfigure_clamps_debt_to_new_burst(impl: ModuleType) -> None:
    table = make(impl, rate=1, burst=100_000)
    table.admit(0, T0, 100, 0)
    table.settle(0, T0, 100, 180, T0)  # 80 tokens over: level -80_000
    assert table.level_mtok(0, T0) == -80_000
    table.configure(0, T0, 1, 50_000, 0, 0, 0, 0)
    assert table.level_mtok(0, T0) == -50_000


def test_reconfigure_with_clock_behind_does_not_move_last_ns_back(impl: ModuleType) -> None:
    table = make(impl, now=T0 + 10 * NS_PER_S)
    table.configure(0, T0, 2_000, 100_000, 0, 0, 0, 0)
    assert table.snapshot(0)["last_ns"] == T0 + 10 * NS_PER_S


def test_remove_forgets_the_slot(impl: ModuleType) -> None:
    table = make(impl, burst=10_000, conc=5)
    assert table.admit(0, T0, 4, 4)[0] == OK
    table.configure(1, T0, 1_000, 10_000, 0, 0, 0, 0)
    assert table.admit(1, T0, 1, 1)[0] == OK
    assert table.total_inflight_tokens() == 10
    table.remove(0)
    assert not table.is_configured(0)
    assert table.total_inflight_tokens() == 2
    calls: list[Callable[[], object]] = [
        lambda: table.admit(0, T0, 1, 1),
        lambda: table.remove(0),
        lambda: table.snapshot(0),
        lambda: table.settle(0, T0, 8, 8, T0),
    ]
    for call in calls:
        with pytest.raises(KeyError):
            call()
    table.configure(0, T0 + 1, 1_000, 10_000, 0, 0, 0, 0)
    assert table.snapshot(0)["level_mtok"] == 10_000  # a fresh, full bucket
    assert table.inflight(0) == 0


@pytest.mark.parametrize("slot", [-1, 1, 3, 4, 10**6, 2**40])
def test_unconfigured_slots_raise_key_error(impl: ModuleType, slot: int) -> None:
    table = make(impl, capacity=4)
    assert not table.is_configured(slot)
    calls: list[Callable[[], object]] = [
        lambda: table.admit(slot, T0, 1, 1),
        lambda: table.settle(slot, T0, 1, 1, T0),
        lambda: table.release(slot, T0, 1),
        lambda: table.level_mtok(slot, T0),
        lambda: table.inflight(slot),
        lambda: table.inflight_tokens(slot),
        lambda: table.snapshot(slot),
        lambda: table.remove(slot),
    ]
    for call in calls:
        with pytest.raises(KeyError):
            call()


# --- argument types ----------------------------------------------------------------


@pytest.mark.parametrize("bad", [1.0, 1.5, "1", None])
def test_non_integers_are_type_errors(impl: ModuleType, bad: object) -> None:
    table = make(impl)
    with pytest.raises(TypeError):
        table.admit(0, T0, bad, 1)
    with pytest.raises(TypeError):
        table.configure(1, T0, bad, 1_000, 0, 0, 0, 0)
    with pytest.raises(TypeError):
        table.settle(0, T0, 1, bad, T0)


@pytest.mark.parametrize("big", [2**63, -(2**63) - 1, 2**80])
def test_out_of_int64_is_overflow_error(impl: ModuleType, big: int) -> None:
    table = make(impl)
    with pytest.raises(OverflowError):
        table.admit(0, big, 1, 1)
    with pytest.raises(OverflowError):
        table.configure(0, T0, 1_000, 1_000, big, 0, 0, 0)


def test_numpy_and_bool_integers_are_accepted(impl: ModuleType) -> None:
    table = make(impl)
    result = table.admit(np.int64(0), np.int64(T0), np.int32(3), True)
    assert result == (OK, 4, 0, 96, -1, -1)
    assert all(type(v) is int for v in result)


@pytest.mark.parametrize(
    ("now", "prompt", "max_tokens", "match"),
    [(-1, 1, 1, "now_ns"), (MAX_NOW_NS + 1, 1, 1, "now_ns"), (T0, -1, 1, "prompt_tokens"),
     (T0, 1, -1, "max_tokens")],
)  # fmt: skip
def test_admit_rejects_bad_arguments(
    impl: ModuleType, now: int, prompt: int, max_tokens: int, match: str
) -> None:
    table = make(impl)
    before = table.snapshot(0)
    with pytest.raises(ValueError, match=match):
        table.admit(0, now, prompt, max_tokens)
    assert table.snapshot(0) == before


# --- admit -------------------------------------------------------------------------


def test_admit_reserves_prompt_plus_max_tokens(impl: ModuleType) -> None:
    table = make(impl, burst=100_000, hourly=1_000, daily=5_000)
    assert table.admit(0, T0, 30, 20) == (OK, 50, 0, 50, 950, 4_950)
    snap = table.snapshot(0)
    assert (snap["level_mtok"], snap["hour_used"], snap["day_used"]) == (50_000, 50, 50)
    assert (snap["inflight"], snap["inflight_tokens"]) == (1, 50)
    assert table.admit(0, T0, 0, 0) == (OK, 0, 0, 50, 950, 4_950)  # a free request
    assert table.inflight(0) == 2


def test_estimate_is_capped_by_max_tokens_per_request(impl: ModuleType) -> None:
    table = make(impl, burst=1_000_000, per_request=100)
    assert table.admit(0, T0, 10, 5_000)[:2] == (OK, 110)
    assert table.admit(0, T0, 10, 40)[:2] == (OK, 50)
    assert table.admit(0, T0, 100, 10**9)[:2] == (OK, 200)  # capped before the ceiling check


@pytest.mark.parametrize(
    ("config", "prompt", "max_tokens"),
    [
        ({"per_request": 100}, 101, 0),  # prompt alone over the per-request cap
        # 21 tokens can never fit a 10-token bucket and one burst of debt (11 can:
        # test_fastpath_debt.py)
        ({"burst": 10_000}, 11, 10),
        ({"daily": 10}, 6, 5),  # nor a 10-token day
        ({"hourly": 10}, 6, 5),  # nor a 10-token hour
        ({"burst": MAX_BURST_MTOK}, MAX_REQUEST_TOKENS + 1, 0),  # over the absolute ceiling
        ({"burst": MAX_BURST_MTOK}, MAX_REQUEST_TOKENS, 1),
        ({"burst": MAX_BURST_MTOK}, 1, 2**63 - 1),
        ({"burst": MAX_BURST_MTOK}, 2**63 - 1, 2**63 - 1),
    ],
)
def test_max_tokens_rejects_requests_that_can_never_fit(
    impl: ModuleType, config: dict[str, int], prompt: int, max_tokens: int
) -> None:
    table = make(impl, **config)
    before = table.snapshot(0)
    reason, reserved, retry, *_ = table.admit(0, T0, prompt, max_tokens)
    assert (reason, reserved, retry) == (MAX_TOKENS, 0, 0)
    assert table.snapshot(0) == before


def test_max_tokens_boundaries_are_admitted(impl: ModuleType) -> None:
    table = make(impl, burst=MAX_BURST_MTOK)
    assert table.admit(0, T0, MAX_REQUEST_TOKENS - 7, 7)[:2] == (OK, MAX_REQUEST_TOKENS)
    table = make(impl, burst=10_000, daily=10, hourly=10)
    assert table.admit(0, T0, 6, 4)[:2] == (OK, 10)


def test_daily_quota(impl: ModuleType) -> None:
    now = T0 + 5 * NS_PER_HOUR
    table = make(impl, now=now, burst=1_000_000, daily=100)
    assert table.admit(0, now, 50, 40) == (OK, 90, 0, 910, -1, 10)
    before = table.snapshot(0)
    assert table.admit(0, now, 11, 0) == (DAILY, 0, NS_PER_DAY - 5 * NS_PER_HOUR, 910, -1, 10)
    assert table.snapshot(0) == before
    assert table.admit(0, now, 10, 0)[:2] == (OK, 10)  # exactly at the quota is fine
    # Next UTC day: the window rolls and the quota is fresh.
    assert table.admit(0, T0 + NS_PER_DAY, 11, 0) == (OK, 11, 0, 989, -1, 89)  # refilled too


def test_hourly_quota(impl: ModuleType) -> None:
    now = T0 + 3 * NS_PER_HOUR + 20 * MIN
    table = make(impl, now=now, burst=1_000_000, hourly=100, daily=1_000)
    assert table.admit(0, now, 100, 0) == (OK, 100, 0, 900, 0, 900)
    assert table.admit(0, now, 1, 0) == (HOURLY, 0, 40 * MIN, 900, 0, 900)
    nxt = T0 + 4 * NS_PER_HOUR
    assert table.admit(0, nxt, 1, 0) == (OK, 1, 0, 999, 99, 899)  # bucket refilled too
    assert table.snapshot(0)["hour_idx"] == nxt // NS_PER_HOUR


def test_windows_do_not_roll_back_when_the_clock_goes_backwards(impl: ModuleType) -> None:
    table = make(impl, burst=1_000_000, hourly=100)
    assert table.admit(0, T0 + NS_PER_HOUR, 100, 0)[0] == OK
    # Back in the previous hour: still the stored (later) window, which is full.
    reason, _, retry, *_ = table.admit(0, T0 + 30 * MIN, 1, 0)
    assert reason == HOURLY
    assert retry == 2 * NS_PER_HOUR - 30 * MIN  # until the stored window ends
    assert table.snapshot(0)["hour_idx"] == (T0 + NS_PER_HOUR) // NS_PER_HOUR


def test_concurrency(impl: ModuleType) -> None:
    table = make(impl, burst=1_000_000, conc=2)
    assert table.admit(0, T0, 1, 1)[0] == OK
    assert table.admit(0, T0, 1, 1)[0] == OK
    assert table.admit(0, T0, 1, 1) == (CONC, 0, 0, 996, -1, -1)
    table.settle(0, T0, 2, 2, T0)
    assert table.admit(0, T0, 1, 1)[0] == OK
    table.release(0, T0, 2)
    assert table.inflight(0) == 1
    assert table.admit(0, T0, 1, 1)[0] == OK


def test_check_order_daily_hourly_concurrency_rate(impl: ModuleType) -> None:
    table = make(impl, rate=1, burst=20_000, hourly=25, daily=30, conc=1)
    assert table.admit(0, T0, 15, 0)[0] == OK  # level 5_000, hour 15/25, day 15/30, 1 in flight
    assert table.admit(0, T0, 16, 0)[0] == DAILY  # every check fails; daily is first
    assert table.admit(0, T0, 11, 0)[0] == HOURLY  # fits the day, not the hour
    assert table.admit(0, T0, 5, 0)[0] == CONC  # fits both quotas and the bucket
    table.release(0, T0, 15)
    assert table.admit(0, T0, 5, 0)[0] == OK  # level now exactly 0, hour and day 20
    table.release(0, T0, 5)
    assert table.admit(0, T0, 1, 0)[0] == TOKEN_RATE


def test_token_rate_retry_is_exact(impl: ModuleType) -> None:
    table = make(impl, rate=1_000, burst=10_000)  # 1 token/s, 10 tokens
    assert table.admit(0, T0, 10, 0) == (OK, 10, 0, 0, -1, -1)
    assert table.admit(0, T0, 1, 0) == (TOKEN_RATE, 0, NS_PER_S, 0, -1, -1)
    assert table.admit(0, T0 + NS_PER_S - 1, 1, 0) == (TOKEN_RATE, 0, 1, 0, -1, -1)
    assert table.admit(0, T0 + NS_PER_S, 1, 0) == (OK, 1, 0, 0, -1, -1)
    assert table.admit(0, T0 + NS_PER_S, 3, 0)[2] == 3 * NS_PER_S


def test_token_rate_retry_with_fractional_rate(impl: ModuleType) -> None:
    table = make(impl, rate=3, burst=1_000)  # 0.003 tokens/s
    table.admit(0, T0, 1, 0)
    # 1000 mtok at 3 mtok/s: ceil(1000e9 / 3) ns.
    assert table.admit(0, T0, 1, 0)[2] == 333_333_333_334
    assert table.level_mtok(0, T0 + 333_333_333_333) == 999
    assert table.admit(0, T0 + 333_333_333_334, 1, 0)[0] == OK


def test_refill_carries_the_sub_mtok_remainder(impl: ModuleType) -> None:
    table = make(impl, rate=3, burst=10_000)
    table.admit(0, T0, 10, 0)
    assert table.level_mtok(0, T0 + NS_PER_S // 10) == 0
    assert table.snapshot(0)["rem"] == 300_000_000
    assert table.level_mtok(0, T0 + 4 * NS_PER_S // 10) == 1  # 1.2 mtok accumulated
    assert table.snapshot(0)["rem"] == 200_000_000
    assert table.level_mtok(0, T0 + 24 * NS_PER_S // 10) == 7
    assert table.snapshot(0)["rem"] == 200_000_000
    # Path independence: one step straight to 2.4 s gives the same state.
    other = make(impl, rate=3, burst=10_000)
    other.admit(0, T0, 10, 0)
    assert other.level_mtok(0, T0 + 24 * NS_PER_S // 10) == 7
    assert other.snapshot(0) == table.snapshot(0)
    # Deficit 993 mtok with rem 0.2 mtok: ceil((993e9 - 2e8) / 3).
    assert table.admit(0, T0 + 24 * NS_PER_S // 10, 1, 0)[2] == 330_933_333_334


@pytest.mark.parametrize(
    ("secs", "level", "rem"),
    [(2_999, 9_598, 200_000_000), (3_000, 9_601, 0), (3_001, 9_601, 0)],
)
def test_refill_around_the_full_shortcut(impl: ModuleType, secs: int, level: int, rem: int) -> None:
    start = T0 + 4 * NS_PER_S // 10
    table = make(impl, rate=3, burst=9_600)
    table.admit(0, T0, 9, 0)
    assert table.level_mtok(0, start) == 601  # 1.2 mtok refilled: rem 0.2 mtok
    table.configure(0, start, 3, 9_601, 0, 0, 0, 0)  # burst - level = 9_000 = 3 mtok/s * 3_000 s
    assert table.level_mtok(0, start + secs * NS_PER_S) == level
    assert table.snapshot(0)["rem"] == rem


def test_refill_stops_at_burst_and_drops_the_remainder(impl: ModuleType) -> None:
    table = make(impl, rate=1_500, burst=10_000)
    table.admit(0, T0, 5, 0)  # 5_000 left
    # 1.333333333 s at 1.5 tokens/s: 1_500 + floor(1_500 * 333_333_333 / 1e9) = 1_999 mtok.
    assert table.level_mtok(0, T0 + NS_PER_S + NS_PER_S // 3) == 6_999
    assert table.snapshot(0)["rem"] == 999_999_500
    assert table.level_mtok(0, T0 + 100 * NS_PER_S) == 10_000
    assert table.snapshot(0)["rem"] == 0
    assert table.snapshot(0)["last_ns"] == T0 + 100 * NS_PER_S


def test_refill_at_top_rate_keeps_the_remainder(impl: ModuleType) -> None:
    table = make(impl, rate=MAX_RATE_MTOK_PER_S - 1, burst=MAX_BURST_MTOK)
    table.admit(0, T0, MAX_REQUEST_TOKENS, 0)
    # 0.7 s * 999_999_999 mtok/s = 699_999_999.3 mtok; rate * sub_ns is ~7e17 here.
    assert table.level_mtok(0, T0 + 7 * NS_PER_S // 10) == MAX_BURST_MTOK - 10**10 + 699_999_999
    assert table.snapshot(0)["rem"] == 300_000_000
    assert table.level_mtok(0, T0 + 30 * NS_PER_S // 10) == MAX_BURST_MTOK - 10**10 + 2_999_999_997
    assert table.snapshot(0)["rem"] == 0


def test_huge_gap_fills_without_overflow(impl: ModuleType) -> None:
    table = make(impl, now=0, rate=MAX_RATE_MTOK_PER_S, burst=MAX_BURST_MTOK)
    table.admit(0, 0, MAX_REQUEST_TOKENS, 0)
    assert table.level_mtok(0, MAX_NOW_NS) == MAX_BURST_MTOK
    table = make(impl, now=0, rate=1, burst=MAX_BURST_MTOK)
    table.admit(0, 0, MAX_REQUEST_TOKENS, 0)
    assert table.level_mtok(0, MAX_NOW_NS) == MAX_BURST_MTOK - 10**10 + MAX_NOW_NS // NS_PER_S


def test_clock_backwards_does_not_refill_and_retry_includes_the_gap(impl: ModuleType) -> None:
    table = make(impl, rate=1_000, burst=10_000)
    table.admit(0, T0 + 10 * NS_PER_S, 10, 0)  # level 0, last_ns T0 + 10 s
    assert table.level_mtok(0, T0 + 5 * NS_PER_S) == 0
    assert table.snapshot(0)["last_ns"] == T0 + 10 * NS_PER_S
    # Refill resumes only after last_ns: 5 s of gap plus 2 s for 2 tokens.
    assert table.admit(0, T0 + 5 * NS_PER_S, 2, 0)[:3] == (TOKEN_RATE, 0, 7 * NS_PER_S)
    assert table.admit(0, T0 + 12 * NS_PER_S, 2, 0)[0] == OK


def test_retry_saturates_when_the_wait_does_not_fit_int64(impl: ModuleType) -> None:
    table = make(impl, rate=1, burst=MAX_REQUEST_TOKENS * 1_000)
    table.admit(0, T0, MAX_REQUEST_TOKENS, 0)
    # 1e10 mtok at 1 mtok/s is 1e19 ns, past int64: saturates.
    assert table.admit(0, T0, MAX_REQUEST_TOKENS, 0)[:3] == (TOKEN_RATE, 0, RETRY_AFTER_NS_MAX)
    # 9e9 mtok (9e18 ns) still fits.
    assert table.admit(0, T0, 9_000_000, 0)[:3] == (TOKEN_RATE, 0, 9 * 10**18)
    # A wait that fits, plus the gap back to last_ns (clock went backwards), may not.
    late = T0 + 10**18
    table = make(impl, rate=1, burst=MAX_REQUEST_TOKENS * 1_000)
    table.admit(0, late, MAX_REQUEST_TOKENS, 0)  # level 0, last_ns = late
    assert table.admit(0, T0, 1_000_000, 0)[2] == 10**18 + 10**18
    assert table.admit(0, T0, 9_000_000, 0)[2] == RETRY_AFTER_NS_MAX


def test_remaining_outputs_clamp_and_use_minus_one_for_unlimited(impl: ModuleType) -> None:
    table = make(impl, burst=10_000, hourly=10, daily=0)
    table.admit(0, T0, 5, 0)
    table.settle(0, T0, 5, 30, T0)  # 25 extra: level -20_000, hour_used 30 > quota 10
    assert table.admit(0, T0, 1, 0) == (HOURLY, 0, NS_PER_HOUR, 0, 0, -1)


# --- settle / release --------------------------------------------------------------


def test_settle_refunds_unused_tokens(impl: ModuleType) -> None:
    table = make(impl, burst=100_000, hourly=1_000, daily=2_000)
    table.admit(0, T0, 20, 60)  # 80 reserved, level 20_000
    assert table.settle(0, T0 + NS_PER_S, 80, 30, T0) == 50
    snap = table.snapshot(0)
    assert snap["level_mtok"] == 20_000 + 1_000 + 50_000  # refill 1 token + refund 50
    assert (snap["hour_used"], snap["day_used"]) == (30, 30)
    assert (snap["inflight"], snap["inflight_tokens"]) == (0, 0)
    assert table.total_inflight_tokens() == 0


def test_settle_refund_is_capped_at_burst(impl: ModuleType) -> None:
    table = make(impl, rate=7, burst=10_000)
    table.admit(0, T0, 5, 0)
    table.level_mtok(0, T0 + NS_PER_S // 2)  # rem becomes non-zero
    assert table.snapshot(0)["rem"] == 500_000_000
    assert table.settle(0, T0 + NS_PER_S // 2, 5, 0, T0) == 5
    assert table.snapshot(0)["level_mtok"] == 10_000
    assert table.snapshot(0)["rem"] == 0  # a full bucket carries no fraction


def test_settle_refund_goes_only_to_the_window_it_was_charged_to(impl: ModuleType) -> None:
    admitted = T0 + 59 * MIN
    table = make(impl, now=admitted, burst=1_000_000, hourly=1_000, daily=1_000)
    table.admit(0, admitted, 100, 0)
    table.admit(0, T0 + 60 * MIN, 70, 0)  # the next hour: hour_used 70, day_used 170
    assert table.settle(0, T0 + 61 * MIN, 100, 40, admitted) == 60
    snap = table.snapshot(0)
    assert snap["hour_idx"] == (T0 + 61 * MIN) // NS_PER_HOUR
    assert snap["hour_used"] == 70  # the refund is not taken from the new hour
    assert snap["day_used"] == 110  # same day: refunded
    table.settle(0, T0 + 61 * MIN, 70, 0, T0 + 60 * MIN)
    snap = table.snapshot(0)
    assert (snap["hour_used"], snap["day_used"]) == (0, 40)
    # Next day, an admission from yesterday refunds neither window.
    table.admit(0, T0 + 61 * MIN, 100, 0)
    table.settle(0, T0 + NS_PER_DAY + 1, 100, 0, T0 + 61 * MIN)
    snap = table.snapshot(0)
    assert (snap["hour_used"], snap["day_used"]) == (0, 0)
    assert snap["level_mtok"] == 1_000_000


def test_settle_refund_clamps_used_at_zero(impl: ModuleType) -> None:
    table = make(impl, burst=1_000_000, hourly=1_000, daily=1_000)
    table.admit(0, T0, 10, 0)
    table.settle(0, T0, 100, 0, T0)  # claims more was reserved than was charged
    snap = table.snapshot(0)
    assert (snap["hour_used"], snap["day_used"], snap["inflight_tokens"]) == (0, 0, 0)


def test_settle_overuse_charges_extra_and_allows_debt_down_to_minus_burst(
    impl: ModuleType,
) -> None:
    table = make(impl, rate=1_000, burst=10_000, hourly=100, daily=100)
    table.admit(0, T0, 5, 5)
    assert table.settle(0, T0, 10, 14, T0) == 0
    snap = table.snapshot(0)
    assert (snap["level_mtok"], snap["hour_used"], snap["day_used"]) == (-4_000, 14, 14)
    assert table.admit(0, T0, 1, 0)[:3] == (TOKEN_RATE, 0, 5 * NS_PER_S)  # repay 4, earn 1
    table.admit(0, T0 + 5 * NS_PER_S, 1, 0)
    table.settle(0, T0 + 5 * NS_PER_S, 1, 50, T0)
    assert table.snapshot(0)["level_mtok"] == -10_000  # 49 over, floored at -burst
    assert table.snapshot(0)["hour_used"] == 64


def test_settle_with_actual_equal_reserved_only_ends_the_request(impl: ModuleType) -> None:
    table = make(impl, hourly=100)
    table.admit(0, T0, 3, 3)
    before = table.snapshot(0)
    assert table.settle(0, T0, 6, 6, T0) == 0
    after = table.snapshot(0)
    assert after["inflight"] == 0
    assert after["inflight_tokens"] == 0
    assert {k: v for k, v in after.items() if not k.startswith("inflight")} == {
        k: v for k, v in before.items() if not k.startswith("inflight")
    }


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((T0, -1, 0, T0), "reserved_tokens"),
        ((T0, 0, -1, T0), "actual_tokens"),
        ((T0, MAX_REQUEST_TOKENS + 1, 0, T0), "reserved_tokens"),
        ((T0, 0, MAX_REQUEST_TOKENS + 1, T0), "actual_tokens"),
        ((-1, 0, 0, T0), "now_ns"),
        ((T0, 0, 0, -1), "admitted_ns"),
    ],
)
def test_settle_rejects_bad_arguments(
    impl: ModuleType, args: tuple[int, int, int, int], match: str
) -> None:
    table = make(impl)
    table.admit(0, T0, 1, 1)
    before = table.snapshot(0)
    with pytest.raises(ValueError, match=match):
        table.settle(0, *args)
    assert table.snapshot(0) == before


def test_release_keeps_the_charge(impl: ModuleType) -> None:
    table = make(impl, burst=10_000, hourly=100)
    table.admit(0, T0, 2, 2)
    table.release(0, T0, 4)
    snap = table.snapshot(0)
    assert (snap["level_mtok"], snap["hour_used"]) == (6_000, 4)
    assert (snap["inflight"], snap["inflight_tokens"]) == (0, 0)
    table.release(0, T0, 4)  # a second release cannot go below zero
    assert (table.inflight(0), table.inflight_tokens(0), table.total_inflight_tokens()) == (
        0, 0, 0,
    )  # fmt: skip
    with pytest.raises(ValueError, match="reserved_tokens"):
        table.release(0, T0, -1)


def test_total_inflight_tokens_is_a_running_sum(impl: ModuleType) -> None:
    table = make(impl, burst=1_000_000)
    table.configure(3, T0, 1_000, 1_000_000, 0, 0, 0, 0)
    table.admit(0, T0, 10, 0)
    table.admit(0, T0, 20, 0)
    table.admit(3, T0, 5, 0)
    assert (table.inflight_tokens(0), table.inflight_tokens(3)) == (30, 5)
    assert table.total_inflight_tokens() == 35
    table.settle(0, T0, 10, 3, T0)
    table.release(3, T0, 5)
    assert table.total_inflight_tokens() == 20
    table.admit(0, T0, 1, 0)[0]
    table.admit(0, T0, 0, 100_000)  # rejected: nothing reserved
    assert table.total_inflight_tokens() == 21


# --- global in-flight watermark ----------------------------------------------------

WATERMARK = Reason.GLOBAL_WATERMARK


def two_tenants(impl: ModuleType, limit: int, **config: int) -> Any:
    table = make(impl, burst=1_000_000, **config)
    table.configure(1, T0, 1_000, 1_000_000, 0, 0, 0, 0)
    table.set_global_inflight_limit(limit)
    return table


def test_global_limit_is_off_by_default_and_settable(impl: ModuleType) -> None:
    table = make(impl)
    assert table.global_inflight_limit() == 0
    table.set_global_inflight_limit(1_234)
    assert table.global_inflight_limit() == 1_234
    table.set_global_inflight_limit(MAX_GLOBAL_INFLIGHT_TOKENS)
    assert table.global_inflight_limit() == MAX_GLOBAL_INFLIGHT_TOKENS
    table.set_global_inflight_limit(0)
    assert table.global_inflight_limit() == 0


@pytest.mark.parametrize(
    ("value", "error"),
    [(-1, ValueError), (MAX_GLOBAL_INFLIGHT_TOKENS + 1, ValueError), (1.0, TypeError),
     (2**63, OverflowError)],
)  # fmt: skip
def test_global_limit_rejects_bad_values(impl: ModuleType, value: Any, error: type) -> None:
    table = make(impl)
    table.set_global_inflight_limit(7)
    with pytest.raises(error, match="tokens" if error is ValueError else None):
        table.set_global_inflight_limit(value)
    assert table.global_inflight_limit() == 7


def test_global_watermark_caps_the_sum_over_tenants(impl: ModuleType) -> None:
    table = two_tenants(impl, 100)
    assert table.admit(0, T0, 60, 0)[:2] == (OK, 60)
    before = (table.snapshot(0), table.snapshot(1))
    # Tenant 1's own bucket holds 1000 tokens, but 60 + 50 > 100 over both tenants.
    assert table.admit(1, T0, 30, 20) == (WATERMARK, 0, 0, 1_000, -1, -1)
    assert (table.snapshot(0), table.snapshot(1)) == before
    assert table.total_inflight_tokens() == 60
    assert table.admit(1, T0, 40, 0)[:2] == (OK, 40)  # exactly at the limit is fine
    assert table.admit(1, T0, 0, 0)[:2] == (OK, 0)  # a free request still fits
    assert table.admit(0, T0, 1, 0)[:3] == (WATERMARK, 0, 0)
    table.settle(0, T0, 60, 10, T0)  # 40 in flight now
    assert table.admit(1, T0, 30, 20)[:2] == (OK, 50)
    assert table.total_inflight_tokens() == 90
    table.remove(1)  # forgetting a slot takes its in-flight tokens out of the sum
    assert table.total_inflight_tokens() == 0
    assert table.admit(0, T0, 100, 0)[:2] == (OK, 100)


def test_request_bigger_than_the_watermark_is_max_tokens(impl: ModuleType) -> None:
    table = two_tenants(impl, 100)
    before = table.snapshot(0)
    assert table.admit(0, T0, 60, 41)[:3] == (MAX_TOKENS, 0, 0)  # can never fit
    assert table.snapshot(0) == before
    assert table.admit(0, T0, 60, 40)[:2] == (OK, 100)


def test_tenant_checks_come_before_the_watermark(impl: ModuleType) -> None:
    table = two_tenants(impl, 10, hourly=15, conc=2)
    table.configure(0, T0, 1_000, 12_000, 15, 0, 2, 0)
    assert table.admit(0, T0, 10, 0)[0] == OK  # 10 in flight: the watermark is reached
    assert table.admit(0, T0, 6, 0)[0] == HOURLY
    assert table.admit(0, T0, 3, 0)[:3] == (TOKEN_RATE, 0, NS_PER_S)  # 2 tokens in bucket
    assert table.admit(0, T0, 2, 0)[0] == WATERMARK
    assert table.admit(1, T0, 1, 0)[0] == WATERMARK
    assert table.admit(0, T0, 0, 0)[0] == OK  # 10 + 0 <= 10
    assert table.admit(0, T0, 0, 0)[0] == CONC  # two in flight


def test_lowering_the_watermark_below_the_load_only_refuses_new_work(impl: ModuleType) -> None:
    table = two_tenants(impl, 0)
    table.admit(0, T0, 80, 0)
    table.admit(1, T0, 80, 0)
    table.set_global_inflight_limit(100)
    assert table.total_inflight_tokens() == 160  # nothing in flight is touched
    assert table.admit(1, T0, 0, 0)[0] == WATERMARK  # 160 + 0 > 100
    table.settle(0, T0, 80, 80, T0)
    assert table.admit(1, T0, 20, 0)[0] == OK
    table.set_global_inflight_limit(0)  # off again
    assert table.admit(1, T0, 500, 0)[0] == OK


# --- charge: shadow mode -----------------------------------------------------------


def test_charge_of_an_admissible_request_is_admit(impl: ModuleType) -> None:
    shadow = make(impl, burst=100_000, hourly=1_000, daily=5_000, conc=3)
    real = make(impl, burst=100_000, hourly=1_000, daily=5_000, conc=3)
    for now, prompt, max_tokens in [(T0, 30, 20), (T0 + 3, 5, 0), (T0 + NS_PER_S, 0, 7)]:
        assert shadow.charge(0, now, prompt, max_tokens) == real.admit(0, now, prompt, max_tokens)
        assert shadow.snapshot(0) == real.snapshot(0)
    assert shadow.total_inflight_tokens() == real.total_inflight_tokens() == 62


def test_charge_reserves_even_when_the_bucket_is_short(impl: ModuleType) -> None:
    table = make(impl, rate=1_000, burst=10_000)
    assert table.admit(0, T0, 8, 0)[:2] == (OK, 8)  # level 2_000
    # admit would answer TOKEN_RATE (3 tokens short at 1 token/s); the request runs anyway.
    assert table.charge(0, T0, 5, 0) == (TOKEN_RATE, 5, 3 * NS_PER_S, 0, -1, -1)
    snap = table.snapshot(0)
    assert (snap["level_mtok"], snap["inflight"], snap["inflight_tokens"]) == (-3_000, 2, 13)
    assert table.total_inflight_tokens() == 13
    # The debt is repaid first: a 1-token request waits 4 s.
    assert table.admit(0, T0, 1, 0)[:3] == (TOKEN_RATE, 0, 4 * NS_PER_S)
    # A shadow reservation settles like any other: 2 of 5 used, 3 refunded.
    assert table.settle(0, T0, 5, 2, T0) == 3
    assert table.snapshot(0)["level_mtok"] == 0
    assert table.total_inflight_tokens() == 8


def test_charge_floors_the_debt_at_minus_burst(impl: ModuleType) -> None:
    table = make(impl, rate=1_000, burst=10_000, hourly=100)
    # 25 tokens can never fit a 10-token bucket: MAX_TOKENS, but reserved all the same.
    assert table.charge(0, T0, 20, 5) == (MAX_TOKENS, 25, 0, 0, 75, -1)
    assert table.snapshot(0)["level_mtok"] == -10_000
    assert table.charge(0, T0, 1, 0) == (TOKEN_RATE, 1, 11 * NS_PER_S, 0, 74, -1)
    assert table.snapshot(0)["level_mtok"] == -10_000
    table.release(0, T0, 25)
    table.release(0, T0, 1)
    assert (table.inflight(0), table.total_inflight_tokens()) == (0, 0)


def test_charge_past_quotas_and_concurrency(impl: ModuleType) -> None:
    now = T0 + 20 * NS_PER_HOUR
    table = make(impl, now=now, burst=1_000_000, daily=10, conc=1)
    assert table.charge(0, now, 8, 0)[:2] == (OK, 8)
    assert table.charge(0, now, 1, 0) == (CONC, 1, 0, 991, -1, 1)
    assert table.charge(0, now, 5, 0) == (DAILY, 5, 4 * NS_PER_HOUR, 986, -1, 0)
    snap = table.snapshot(0)
    assert (snap["day_used"], snap["inflight"], snap["inflight_tokens"]) == (14, 3, 14)
    assert table.admit(0, now, 0, 0)[0] == DAILY  # the day is over its quota: first check


def test_charge_over_the_ceiling_reserves_the_largest_request(impl: ModuleType) -> None:
    table = make(impl, burst=MAX_BURST_MTOK, per_request=100)
    big = (MAX_TOKENS, MAX_REQUEST_TOKENS, 0)
    assert table.charge(0, T0, 2**63 - 1, 2**63 - 1)[:3] == big
    assert table.charge(0, T0, MAX_REQUEST_TOKENS + 1, 0)[:3] == big
    # Over the per-request cap but under the ceiling: the cost is prompt + capped estimate.
    assert table.charge(0, T0, 101, 10**9)[:3] == (MAX_TOKENS, 201, 0)
    assert table.inflight_tokens(0) == 2 * MAX_REQUEST_TOKENS + 201
    for reserved in (MAX_REQUEST_TOKENS, MAX_REQUEST_TOKENS, 201):
        table.settle(0, T0, reserved, 0, T0)
    assert table.total_inflight_tokens() == 0
    assert table.snapshot(0)["level_mtok"] == MAX_BURST_MTOK


def test_charge_passes_the_global_watermark(impl: ModuleType) -> None:
    table = two_tenants(impl, 10)
    assert table.charge(0, T0, 8, 0)[:2] == (OK, 8)
    assert table.charge(1, T0, 5, 0)[:3] == (WATERMARK, 5, 0)
    assert table.charge(1, T0, 11, 0)[:3] == (MAX_TOKENS, 11, 0)
    assert table.total_inflight_tokens() == 24
    assert table.admit(0, T0, 0, 0)[0] == WATERMARK


def test_charge_validates_like_admit(impl: ModuleType) -> None:
    table = make(impl)
    before = table.snapshot(0)
    for args, error in [
        ((0, -1, 1, 1), ValueError),
        ((0, T0, -1, 1), ValueError),
        ((0, T0, 1, -1), ValueError),
        ((1, T0, 1, 1), KeyError),
        ((0, T0, 1.0, 1), TypeError),
        ((0, 2**63, 1, 1), OverflowError),
    ]:
        with pytest.raises(error):
            table.charge(*args)
    assert table.snapshot(0) == before


def test_add_usage_restores_quota_counters_in_the_current_windows(impl: Any) -> None:
    hour = 3_600_000_000_000
    t = impl.TokenBucketTable()
    now = 1_000 * hour + 5
    t.configure(0, now, 1000, 10_000_000, 5000, 20_000, 0, 0)
    t.add_usage(0, now, 4000, 15_000)
    snap = t.snapshot(0)
    assert (snap["hour_used"], snap["day_used"]) == (4000, 15_000)
    assert snap["level_mtok"] == 10_000_000 and snap["inflight"] == 0  # nothing else moved
    assert t.admit(0, now, 1500, 0)[0] == 2  # HOURLY_QUOTA: 4000 + 1500 > 5000
    assert t.admit(0, now + hour, 1500, 0)[0] == 0  # next hour: the hour counter rolled
    with pytest.raises(ValueError, match="hour_tokens"):
        t.add_usage(0, now, -1, 0)
    with pytest.raises(ValueError, match="day_tokens"):
        t.add_usage(0, now, 0, 10**15 + 1)


def test_fill_tops_the_bucket_up_to_its_burst_and_touches_nothing_else(impl: Any) -> None:
    t = impl.TokenBucketTable()
    now = 10**12
    t.configure(0, now, 1000, 10_000_000, 50_000, 0, 0, 0)
    assert t.admit(0, now, 9000, 0)[0] == 0
    before = t.snapshot(0)
    t.fill(0, now + 1)
    after = t.snapshot(0)
    assert after["level_mtok"] == 10_000_000 and after["rem"] == 0
    same = ("hour_used", "day_used", "inflight", "inflight_tokens", "burst_mtok")
    assert {k: after[k] for k in same} == {k: before[k] for k in same}
    assert t.admit(0, now + 1, 10_000, 0)[0] == 0  # the whole burst again
    with pytest.raises(ValueError, match="now_ns"):
        t.fill(0, -1)

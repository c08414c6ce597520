"""Bucket debt, on both builds: a request over the burst waits for a full
bucket and goes into debt instead of being refused for good (always); with
``set_bucket_debt`` a tenant's own bursts are admitted while its bucket is
non-negative and charged in full, down to one burst of debt."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from fastpath.codes import Reason

S = 1_000_000_000
RATE = 1_000  # tokens/s
BURST = 10_000  # tokens


def table(impl: ModuleType, debt: bool) -> Any:
    t = impl.TokenBucketTable()
    t.configure(0, 0, RATE * 1000, BURST * 1000, 0, 0, 0, 0)
    t.set_bucket_debt(debt)
    return t


def test_without_debt_the_level_must_cover_the_cost(impl: ModuleType) -> None:
    t = table(impl, debt=False)
    assert t.admit(0, 0, 8_000, 0)[0] == Reason.OK
    reason, _, retry, *_ = t.admit(0, 0, 3_000, 0)
    assert (reason, retry) == (Reason.TOKEN_RATE, 1 * S)  # 1,000 tokens short at 1,000/s
    # over the burst: waits for a full bucket (8 s of refill), not refused for good
    reason, _, retry, *_ = t.admit(0, 0, 15_000, 0)
    assert (reason, retry) == (Reason.TOKEN_RATE, 8 * S)
    reason, reserved, *_ = t.admit(0, 8 * S, 15_000, 0)
    assert (reason, reserved) == (Reason.OK, 15_000)  # level -5,000, charged in full
    reason, _, retry, *_ = t.admit(0, 8 * S, 1_000, 0)
    assert (reason, retry) == (Reason.TOKEN_RATE, 6 * S)  # repays the debt first
    # more than two bursts can never fit within one burst of debt
    assert t.admit(0, 100 * S, 20_001, 0)[0] == Reason.MAX_TOKENS


def test_with_debt_a_non_negative_level_admits_the_full_cost(impl: ModuleType) -> None:
    t = table(impl, debt=True)
    assert t.admit(0, 0, 8_000, 0)[0] == Reason.OK  # level 2,000
    reason, reserved, *_ = t.admit(0, 0, 3_000, 0)
    assert (reason, reserved) == (Reason.OK, 3_000)  # into debt: level -1,000
    reason, _, retry, bucket, *_ = t.admit(0, 0, 10, 0)
    assert (reason, retry, bucket) == (Reason.TOKEN_RATE, 1 * S, 0)  # until level 0
    assert t.admit(0, 1 * S, 10, 0)[0] == Reason.OK


def test_with_debt_a_request_over_the_burst_waits_for_a_full_bucket(impl: ModuleType) -> None:
    t = table(impl, debt=True)
    assert t.admit(0, 0, 5_000, 0)[0] == Reason.OK  # level 5,000
    reason, _, retry, *_ = t.admit(0, 0, 15_000, 0)
    assert (reason, retry) == (Reason.TOKEN_RATE, 5 * S)  # waits until the bucket is full
    reason, reserved, *_ = t.admit(0, 5 * S, 15_000, 0)
    assert (reason, reserved) == (Reason.OK, 15_000)  # level -5,000: within one burst
    # more than two bursts can never fit within one burst of debt
    assert t.admit(0, 100 * S, 20_001, 0)[0] == Reason.MAX_TOKENS


def test_debt_never_passes_one_burst(impl: ModuleType) -> None:
    t = table(impl, debt=True)
    now = 0
    for _ in range(50):
        t.admit(0, now, 9_999, 0)
        level = t.level_mtok(0, now)
        assert level >= -BURST * 1000
        now += S // 3

"""RateLimitResponse building: statuses, the limit reported, headers."""

from __future__ import annotations

from decimal import Decimal

from controlplane._proto.envoy.service.ratelimit.v3 import rls_pb2 as rls
from controlplane.integrations.envoy import answers as A
from controlplane.service.limits import UNLIMITED, TenantLimits
from fastpath import Reason

R = rls.RateLimitResponse
NS = 1_000_000_000


def limits(bucket: int = 900, hourly: int = UNLIMITED, hourly_left: int = UNLIMITED,
           ) -> TenantLimits:  # fmt: skip
    return TenantLimits(
        tenant_id="t", token_rate=Decimal("12.5"), burst_tokens=1000, bucket_tokens=bucket,
        bucket_full_in_ms=8_001, hourly_quota=hourly, hourly_remaining=hourly_left,
        daily_quota=UNLIMITED, daily_remaining=UNLIMITED, max_concurrency=UNLIMITED,
        inflight_requests=0, hour_resets_in_ms=1_800_000, day_resets_in_ms=40_000_000,
    )  # fmt: skip


def header_map(resp: R) -> dict[str, str]:
    return {h.key: h.value for h in resp.response_headers_to_add}


def test_admitted_reports_the_bucket_per_mapped_descriptor() -> None:
    v = A.Verdict(over=False, window=A.binding(limits(), 0, 0))
    resp = A.response(v, (True, False), with_headers=True)
    assert resp.overall_code == R.OK
    mine, other = resp.statuses
    assert (mine.code, mine.current_limit.name, mine.current_limit.requests_per_unit,
            mine.current_limit.unit, mine.limit_remaining) == (
        R.OK, "token_bucket", 12, R.RateLimit.SECOND, 900)  # fmt: skip
    assert (mine.duration_until_reset.seconds, mine.duration_until_reset.nanos) == (8, 1_000_000)
    assert other == R.DescriptorStatus(code=R.OK)  # not burstgate's: a bare OK
    assert header_map(resp) == {"x-ratelimit-limit": "1000", "x-ratelimit-remaining": "900",
                                "x-ratelimit-reset": "9"}  # fmt: skip


def test_the_closest_limit_is_reported_when_admitted() -> None:
    w = A.binding(limits(hourly=5000, hourly_left=300), 0, 0)
    assert w is not None and (w.name, w.unit, w.remaining, w.limit) == (
        "hourly_quota", R.RateLimit.HOUR, 300, 5000)  # fmt: skip


def test_over_limit_has_retry_after_and_the_refusing_limit() -> None:
    retry = 2_500_000_000
    v = A.Verdict(over=True, reason=int(Reason.TOKEN_RATE), retry_after_ns=retry,
                  window=A.binding(limits(bucket=0), int(Reason.TOKEN_RATE), retry))  # fmt: skip
    resp = A.response(v, (True,), with_headers=True)
    assert resp.overall_code == R.OVER_LIMIT
    s = resp.statuses[0]
    assert (s.code, s.limit_remaining) == (R.OVER_LIMIT, 0)
    assert (s.duration_until_reset.seconds, s.duration_until_reset.nanos) == (2, 500_000_000)
    assert header_map(resp) == {
        "x-ratelimit-limit": "1000", "x-ratelimit-remaining": "0", "x-ratelimit-reset": "3",
        "retry-after": "3", "x-burstgate-reason": "token_rate", "x-should-retry": "true",
    }  # fmt: skip
    # a refusal a retry cannot cure (a request past its deadline) says so
    late = A.Verdict(over=True, reason=int(Reason.BACKPRESSURE), retry_after_ns=retry,
                     retryable=False)  # fmt: skip
    assert header_map(A.response(late, (True,), True))["x-should-retry"] == "false"


def test_hourly_quota_refusal_reports_the_hour() -> None:
    reason = int(Reason.HOURLY_QUOTA)
    w = A.binding(limits(hourly=5000, hourly_left=0), reason, 1_800_000 * 1_000_000)
    v = A.Verdict(over=True, reason=reason, retry_after_ns=1_800 * NS, window=w)
    assert header_map(A.response(v, (True,), True))["x-ratelimit-reset"] == "1800"


def test_headers_off_and_refusals_without_a_tenant() -> None:
    assert not A.response(A.Verdict(over=False, window=A.binding(limits(), 0, 0)), (True,),
                          with_headers=False).response_headers_to_add  # fmt: skip
    unknown = A.Verdict(over=True, reason=int(Reason.UNKNOWN_TENANT))  # nothing to retry
    assert header_map(A.response(unknown, (True,), True)) == {
        "x-burstgate-reason": "unknown_tenant", "x-should-retry": "false",
    }  # fmt: skip
    bad = A.response(A.Verdict(over=True, error="tenant: missing"), (True,), with_headers=False)
    assert header_map(bad) == {"x-burstgate-error": "tenant: missing"}  # errors always say why

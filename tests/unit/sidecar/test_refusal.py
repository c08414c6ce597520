"""What a client sees on a refusal: status, OpenAI-style body, retry and
rate-limit headers (docs/sidecar.md)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from burstgate_client.sidecar.refusal import format_reset, ratelimit_headers, refusal

from tests.sidecar_support import FakeAdmission, FakeLimits, refused


@pytest.mark.parametrize(
    ("ms", "text"),
    [(0, "0ms"), (20, "20ms"), (999, "999ms"), (1000, "1s"), (1500, "1.5s"), (59_999, "59.999s"),
     (360_000, "6m0s"), (61_250, "1m1.25s"), (3_723_000, "1h2m3s"), (7_200_000, "2h0m0s")],
)  # fmt: skip
def test_resets_are_written_as_openai_does(ms: int, text: str) -> None:
    assert format_reset(ms) == text


def answer(a: FakeAdmission, limits: FakeLimits | None = None) -> tuple[int, Any, dict[str, str]]:
    resp = refusal(a, tenant="acme", request_id="r1", limits=limits,
                   unavailable_retry_after_ms=1000)  # fmt: skip
    assert resp.body is not None and resp.content_type == "application/json"
    return resp.status, json.loads(bytes(resp.body))["error"], dict(resp.headers)  # type: ignore[arg-type]


def test_a_rate_refusal_is_a_429_with_retry_and_ratelimit_headers() -> None:
    status, err, h = answer(refused("token_rate", 1200, bucket_remaining=40), FakeLimits())
    assert status == 429
    assert err["code"] == "rate_limit_exceeded" and err["type"] == "tokens"
    assert "r1" in err["message"] and "token_rate" in err["message"] and err["param"] is None
    assert h["retry-after"] == "2" and h["retry-after-ms"] == "1200"  # seconds rounded up
    assert h["x-burstgate-reason"] == "token_rate"
    assert h["x-should-retry"] == "true"
    assert h["x-ratelimit-limit-tokens"] == "1000"
    assert h["x-ratelimit-remaining-tokens"] == "40"  # the admission's, fresher than GetLimits
    assert h["x-ratelimit-reset-tokens"] == "9.6s"  # (1000 - 40) tokens at 100/s
    assert h["x-ratelimit-limit-requests"] == "8" and h["x-ratelimit-remaining-requests"] == "5"
    assert h["x-ratelimit-reset-requests"] == "0ms"


def test_concurrency_is_the_requests_limit() -> None:
    limits = FakeLimits(inflight_requests=8)
    status, err, h = answer(refused("concurrency", 250, bucket_remaining=0), limits)
    assert status == 429 and err["type"] == "requests" and err["code"] == "rate_limit_exceeded"
    assert h["x-ratelimit-remaining-tokens"] == "400"  # not the bucket's refusal: GetLimits' level
    assert h["x-ratelimit-remaining-requests"] == "0" and h["x-ratelimit-reset-requests"] == "250ms"
    unlimited = answer(refused("concurrency", 250), FakeLimits(max_concurrency=-1))[2]
    assert not any("requests" in k for k in unlimited)


@pytest.mark.parametrize("reason", ["queue_timeout", "backpressure", "queue_full",
                                    "global_watermark", "open_reservations"])  # fmt: skip
def test_capacity_refusals_are_429_retryable(reason: str) -> None:
    status, err, h = answer(refused(reason, 300))
    assert status == 429 and err["code"] == "rate_limit_exceeded"
    assert h["retry-after-ms"] == "300" and h["x-should-retry"] == "true"


def test_an_exhausted_quota_is_insufficient_quota_and_not_to_be_retried() -> None:
    limits = FakeLimits(hourly_quota=5000, hourly_remaining=0)
    a = refused("hourly_quota", 1_800_000, bucket_remaining=900, hourly_remaining=0)
    status, err, h = answer(a, limits)
    assert status == 429
    assert err["type"] == "insufficient_quota" and err["code"] == "insufficient_quota"
    assert "hourly" in err["message"] and "30m0s" in err["message"]
    assert h["x-should-retry"] == "false" and h["retry-after"] == "1800"
    assert h["x-ratelimit-remaining-tokens"] == "0"  # the quota bounds the bucket's 900
    assert h["x-ratelimit-reset-tokens"] == "30m0s"  # when the hour turns
    daily = answer(refused("daily_quota", 5000, daily_remaining=0), FakeLimits())
    assert daily[1]["code"] == "insufficient_quota" and "daily" in daily[1]["message"]
    assert daily[2]["x-ratelimit-reset-tokens"] == "10h0m0s"


@pytest.mark.parametrize(
    ("reason", "status", "code"),
    [("max_tokens", 400, "request_too_large"), ("unknown_tenant", 401, "invalid_api_key"),
     ("tenant_disabled", 403, "tenant_disabled")],
)  # fmt: skip
def test_refusals_a_retry_cannot_cure(reason: str, status: int, code: str) -> None:
    got, err, h = answer(refused(reason))
    assert got == status and err["code"] == code and err["type"] == "invalid_request_error"
    assert h["x-should-retry"] == "false" and "retry-after" not in h
    assert err["param"] == ("max_tokens" if reason == "max_tokens" else None)


def test_fail_closed_while_unreachable_is_a_503() -> None:
    a = FakeAdmission(admitted=False, reason="unavailable", retryable=True, offline=True,
                      pricing_multiplier="")  # fmt: skip
    status, err, h = answer(a)
    assert status == 503 and err["code"] == "service_unavailable" and err["type"] == "server_error"
    assert h["retry-after"] == "1" and h["retry-after-ms"] == "1000" and "x-ratelimit" not in h
    assert h["x-burstgate-reason"] == "unavailable"
    assert answer(refused("unavailable", 2500))[2]["retry-after"] == "3"


def test_ratelimit_headers_without_limits_or_offline() -> None:
    assert ratelimit_headers(FakeAdmission(bucket_remaining=-50), None) == {
        "x-ratelimit-remaining-tokens": "0"  # a bucket in debt has nothing left
    }
    assert ratelimit_headers(FakeAdmission(offline=True), None) == {}
    assert ratelimit_headers(refused("queue_timeout", bucket_remaining=0), None) == {}
    offline = ratelimit_headers(FakeAdmission(offline=True), FakeLimits())
    assert offline["x-ratelimit-remaining-tokens"] == "400"  # GetLimits' level
    assert offline["x-ratelimit-reset-tokens"] == "6s"

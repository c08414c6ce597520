"""burstgate's answer as Envoy's ``RateLimitResponse``: the overall code, one
``DescriptorStatus`` per descriptor, and the rate-limit headers.

Which limit is reported (docs/envoy.md, "Headers and DescriptorStatus"): the
one that refused the request (token bucket, hourly or daily quota), else the
one with the fewest tokens left, as envoyproxy/ratelimit reports the
descriptor closest to its limit. For the token bucket the headers say the
bucket's size (``x-ratelimit-limit``, as the sidecar's
``x-ratelimit-limit-tokens``), its level and the seconds until it is full
again; ``current_limit`` says its refill rate, tokens per SECOND.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.duration_pb2 import Duration

from controlplane._proto.envoy.config.core.v3.base_pb2 import HeaderValue
from controlplane._proto.envoy.service.ratelimit.v3 import rls_pb2 as rls
from controlplane.domain.units import NS_PER_MS, NS_PER_S
from controlplane.service.limits import UNLIMITED, TenantLimits
from fastpath import Reason

Code = rls.RateLimitResponse.Code
Unit = rls.RateLimitResponse.RateLimit.Unit
UINT32_MAX = 2**32 - 1

LIMIT = "x-ratelimit-limit"
REMAINING = "x-ratelimit-remaining"
RESET = "x-ratelimit-reset"
RETRY_AFTER = "retry-after"
REASON = "x-burstgate-reason"
ERROR = "x-burstgate-error"
SHOULD_RETRY = "x-should-retry"


@dataclass(frozen=True, slots=True)
class Window:
    """One of a tenant's limits, as Envoy's API and the headers say it."""

    name: str  # DescriptorStatus.current_limit.name
    limit: int  # x-ratelimit-limit: the bucket's size, or the quota
    per_unit: int  # current_limit.requests_per_unit
    unit: Unit.ValueType
    remaining: int
    reset_ns: int  # until the bucket is full / the quota's window ends


@dataclass(frozen=True, slots=True)
class Verdict:
    over: bool
    reason: int = 0  # the refusal's Reason (0 when admitted)
    retry_after_ns: int = 0  # 0: retrying will not help (or admitted)
    window: Window | None = None  # None: nothing to report (unknown tenant, bad input)
    error: str = ""  # a request burstgate could not decide: what was wrong
    # A refusal a retry may cure (AdmitResponse.retryable): x-should-retry,
    # which the openai clients obey. False for a request that can no longer
    # meet its deadline (its retry_after is for a fresh request).
    retryable: bool = True


def windows(t: TenantLimits) -> dict[int, Window]:
    """The tenant's limits by the Reason that names them."""
    out = {
        int(Reason.TOKEN_RATE): Window(
            "token_bucket", t.burst_tokens, max(1, round(t.token_rate)), Unit.SECOND,
            max(0, t.bucket_tokens), t.bucket_full_in_ms * NS_PER_MS,
        )
    }  # fmt: skip
    if t.hourly_quota != UNLIMITED:
        out[int(Reason.HOURLY_QUOTA)] = Window(
            "hourly_quota", t.hourly_quota, t.hourly_quota, Unit.HOUR, t.hourly_remaining,
            t.hour_resets_in_ms * NS_PER_MS,
        )  # fmt: skip
    if t.daily_quota != UNLIMITED:
        out[int(Reason.DAILY_QUOTA)] = Window(
            "daily_quota", t.daily_quota, t.daily_quota, Unit.DAY, t.daily_remaining,
            t.day_resets_in_ms * NS_PER_MS,
        )  # fmt: skip
    return out


def binding(t: TenantLimits | None, reason: int, retry_after_ns: int) -> Window | None:
    """The limit to report: the refusing one, else the closest to empty."""
    if t is None:
        return None
    ws = windows(t)
    w = ws.get(reason)
    if w is None:
        return min(ws.values(), key=lambda x: x.remaining)
    if reason == Reason.TOKEN_RATE and retry_after_ns:
        # refused by the bucket: it is "reset" (holds enough) after retry_after
        w = Window(w.name, w.limit, w.per_unit, w.unit, w.remaining, retry_after_ns)
    return w


def _seconds(ns: int) -> int:
    return -(-ns // NS_PER_S)


def _duration(ns: int) -> Duration:
    return Duration(seconds=ns // NS_PER_S, nanos=ns % NS_PER_S)


def headers(v: Verdict) -> list[HeaderValue]:
    out: list[HeaderValue] = []
    w = v.window
    if w is not None:
        out += [
            HeaderValue(key=LIMIT, value=str(w.limit)),
            HeaderValue(key=REMAINING, value=str(w.remaining)),
            HeaderValue(key=RESET, value=str(_seconds(w.reset_ns))),
        ]
    if v.over and v.retry_after_ns > 0:
        out.append(HeaderValue(key=RETRY_AFTER, value=str(max(1, _seconds(v.retry_after_ns)))))
    if v.over and v.reason:
        out.append(HeaderValue(key=REASON, value=Reason(v.reason).name.lower()))
        retry = v.retryable and v.retry_after_ns > 0
        out.append(HeaderValue(key=SHOULD_RETRY, value="true" if retry else "false"))
    if v.error:
        out.append(HeaderValue(key=ERROR, value=v.error[:256]))
    return out


def status(v: Verdict) -> rls.RateLimitResponse.DescriptorStatus:
    s = rls.RateLimitResponse.DescriptorStatus(code=Code.OVER_LIMIT if v.over else Code.OK)
    w = v.window
    if w is not None:
        s.current_limit.name = w.name
        s.current_limit.requests_per_unit = min(w.per_unit, UINT32_MAX)
        s.current_limit.unit = w.unit
        s.limit_remaining = min(w.remaining, UINT32_MAX)
        s.duration_until_reset.CopyFrom(_duration(w.reset_ns))
    if v.over and v.retry_after_ns > 0:
        s.duration_until_reset.CopyFrom(_duration(v.retry_after_ns))
    return s


def response(v: Verdict, mapped: tuple[bool, ...], with_headers: bool) -> rls.RateLimitResponse:
    """``mapped``: per descriptor, whether it carries a burstgate entry (the
    others get a bare OK: not burstgate's)."""
    mine = status(v)
    other = rls.RateLimitResponse.DescriptorStatus(code=Code.OK)
    return rls.RateLimitResponse(
        overall_code=Code.OVER_LIMIT if v.over else Code.OK,
        statuses=[mine if m else other for m in mapped],
        response_headers_to_add=headers(v) if with_headers or v.error else (),
    )

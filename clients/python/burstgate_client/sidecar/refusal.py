"""What a client sees when burstgate says no: OpenAI-style errors and the
rate-limit headers (docs/sidecar.md has the table).

- A refusal a retry can cure (the bucket, concurrency, the gate's queue,
  backpressure, ...): 429, ``code: rate_limit_exceeded``, ``retry-after``
  (whole seconds, rounded up) and ``retry-after-ms``.
- An exhausted hourly or daily quota: 429, ``type`` and ``code``
  ``insufficient_quota``, and ``x-should-retry: false`` (the official
  OpenAI clients honour it; without it they would retry any 429).
- A request that can never fit (``max_tokens``): 400; an unknown tenant:
  401; a disabled tenant: 403.
- Fail-closed while the control plane is unreachable: 503,
  ``code: service_unavailable``, with ``retry-after``.

``x-ratelimit-*`` follow OpenAI's headers with burstgate's limits: the
*tokens* are the tenant's bucket (limit = its burst, remaining = what is left
now, also bounded by the hourly and daily quotas, reset = until the bucket
is full, or until the quota resets when a quota is what ran out); the
*requests* are its concurrency (limit = ``max_concurrency``, remaining = the
free slots; absent when unlimited). Resets are in OpenAI's format: "20ms",
"1.5s", "6m0s".
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from aiohttp import web

from burstgate_client.sidecar.admitter import AdmissionLike, LimitsLike

REASON = "x-burstgate-reason"
_TOKENS = ("token_rate", "global_watermark")
_STATUS = {"max_tokens": 400, "unknown_tenant": 401, "tenant_disabled": 403}
_CODE = {"max_tokens": "request_too_large", "unknown_tenant": "invalid_api_key",
         "tenant_disabled": "tenant_disabled"}  # fmt: skip


def format_reset(ms: int) -> str:
    """A duration as OpenAI's rate-limit headers write it (Go's format)."""
    ms = max(0, ms)
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    seconds = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    out = f"{hours}h" if hours else ""
    if hours or minutes:
        out += f"{minutes}m"
    return out + f"{seconds}s"


def error_body(message: str, kind: str, code: str | None, param: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "param": param,
                                 "code": code}}).encode()  # fmt: skip


def json_error(
    status: int, message: str, kind: str, code: str | None, *, param: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:  # fmt: skip
    return web.Response(status=status, body=error_body(message, kind, code, param),
                        content_type="application/json", headers=headers)  # fmt: skip


def retry_headers(retry_after_ms: int) -> dict[str, str]:
    if retry_after_ms <= 0:
        return {}
    return {"retry-after": str(max(1, math.ceil(retry_after_ms / 1000))),
            "retry-after-ms": str(retry_after_ms)}  # fmt: skip


def ratelimit_headers(a: AdmissionLike | None, limits: LimitsLike | None) -> dict[str, str]:
    """``x-ratelimit-*`` from the tenant's limits and, fresher, the
    admission's remaining figures (either may be missing)."""
    h: dict[str, str] = {}
    if limits is None:
        if a is not None and not a.offline and (a.admitted or a.reason == "token_rate"):
            h["x-ratelimit-remaining-tokens"] = str(max(0, _remaining(a.bucket_remaining, a)))
        return h
    if limits.max_concurrency > 0:
        free = max(0, limits.max_concurrency - limits.inflight_requests)
        h["x-ratelimit-limit-requests"] = str(limits.max_concurrency)
        h["x-ratelimit-remaining-requests"] = str(free)
        wait = a.retry_after_ms if a is not None and a.reason == "concurrency" else 0
        h["x-ratelimit-reset-requests"] = format_reset(wait)
    # The admission's bucket level is the freshest, where it is the bucket's:
    # after an admission, or a token_rate refusal (other refusals carry 0).
    fresh = a is not None and not a.offline and (a.admitted or a.reason == "token_rate")
    level = a.bucket_remaining if fresh and a is not None else limits.bucket_tokens
    h["x-ratelimit-limit-tokens"] = str(limits.burst_tokens)
    h["x-ratelimit-remaining-tokens"] = str(max(0, _remaining(level, a, limits)))
    if a is not None and a.reason == "hourly_quota":
        reset = limits.hour_resets_in_ms
    elif a is not None and a.reason == "daily_quota":
        reset = limits.day_resets_in_ms
    elif fresh and limits.token_rate > 0:
        reset = math.ceil(max(0, limits.burst_tokens - level) / limits.token_rate * 1000)
    else:
        reset = limits.bucket_full_in_ms
    h["x-ratelimit-reset-tokens"] = format_reset(reset)
    return h


def _remaining(level: int, a: AdmissionLike | None, limits: LimitsLike | None = None) -> int:
    """The bucket's level, bounded by the quotas left (-1 = unlimited)."""
    quotas = [a.hourly_remaining, a.daily_remaining] if a is not None else []
    if limits is not None:
        quotas += [limits.hourly_remaining, limits.daily_remaining]
    return min([level, *(q for q in quotas if q >= 0)])


@dataclass(frozen=True, slots=True)
class Refusal:
    """What a client is answered for an Admission that was not admitted:
    OpenAI's error (``status``, ``message``, ``kind`` = ``type``, ``code``,
    ``param``) and the headers. The LiteLLM hook raises the same answer as
    LiteLLM's own exceptions (clients/python/burstgate_client/litellm/refusal.py)."""

    status: int
    message: str
    kind: str
    code: str
    param: str | None
    headers: dict[str, str]


def refusal_of(
    a: AdmissionLike, *, tenant: str, request_id: str, limits: LimitsLike | None,
    unavailable_retry_after_ms: int,
) -> Refusal:  # fmt: skip
    """The answer for an Admission that was not admitted (its reason also
    in ``x-burstgate-reason``, for clients and load generators)."""
    reason = a.reason or "unknown"
    if reason == "unavailable":
        wait = a.retry_after_ms or unavailable_retry_after_ms
        headers = {**retry_headers(wait), "x-should-retry": "true", REASON: reason}
        message = ("burstgate's control plane is unreachable and this lane fails closed; "
                   f"retry later (request {request_id})")  # fmt: skip
        return Refusal(503, message, "server_error", "service_unavailable", None, headers)
    headers = ratelimit_headers(a, limits)
    headers.update(retry_headers(a.retry_after_ms))
    headers[REASON] = reason
    if a.quota_exhausted:
        headers["x-should-retry"] = "false"
        window = "hourly" if reason == "hourly_quota" else "daily"
        message = (f"You exceeded your {window} token quota (tenant {tenant}); it resets "
                   f"in {format_reset(a.retry_after_ms)}. Request {request_id}.")  # fmt: skip
        return Refusal(429, message, "insufficient_quota", "insufficient_quota", None, headers)
    if reason in _STATUS:
        headers["x-should-retry"] = "false"
        message = {
            "max_tokens": f"The request can never fit tenant {tenant}'s limits: lower "
                          "max_tokens or the prompt.",
            "unknown_tenant": f"Tenant {tenant} is not known to burstgate.",
            "tenant_disabled": f"Tenant {tenant} is disabled.",
        }[reason] + f" Request {request_id}."  # fmt: skip
        param = "max_tokens" if reason == "max_tokens" else None
        return Refusal(_STATUS[reason], message, "invalid_request_error", _CODE[reason], param,
                       headers)  # fmt: skip
    headers["x-should-retry"] = "true" if a.retryable else "false"
    kind = "tokens" if reason in _TOKENS else "requests"
    after = f" Please try again in {format_reset(a.retry_after_ms)}." if a.retry_after_ms else ""
    message = f"Rate limit reached for tenant {tenant} ({reason}).{after} Request {request_id}."
    return Refusal(429, message, kind, "rate_limit_exceeded", None, headers)


def refusal(
    a: AdmissionLike, *, tenant: str, request_id: str, limits: LimitsLike | None,
    unavailable_retry_after_ms: int,
) -> web.Response:  # fmt: skip
    """The response for an Admission that was not admitted."""
    r = refusal_of(a, tenant=tenant, request_id=request_id, limits=limits,
                   unavailable_retry_after_ms=unavailable_retry_after_ms)  # fmt: skip
    return json_error(r.status, r.message, r.kind, r.code, param=r.param, headers=r.headers)

"""burstgate's refusals as the exceptions LiteLLM's proxy answers with.

A 429 is LiteLLM's own ``ProxyRateLimitError`` (what its rate limiters
raise: a ``fastapi.HTTPException`` and a ``litellm.RateLimitError`` at
once), so the proxy answers it as it answers its own limits, with the
headers given: ``retry-after`` (whole seconds), ``retry-after-ms``,
``x-should-retry``, ``x-ratelimit-*``, ``x-burstgate-reason``. Other answers
(400 ``max_tokens``, 401 unknown tenant, 403 disabled or no tenant, 503 fail
closed) are ``fastapi.HTTPException`` with the status. The status, the
message and the headers are the sidecar's (clients/python/burstgate_client/sidecar/refusal.py);
the body is LiteLLM's error format.
"""

from __future__ import annotations

from fastapi import HTTPException
from litellm.exceptions import RateLimitErrorCategory, RateLimitType
from litellm.proxy.common_utils.proxy_rate_limit_error import ProxyRateLimitError

from burstgate_client.sidecar.admitter import AdmissionLike, LimitsLike
from burstgate_client.sidecar.refusal import REASON, refusal_of

_TYPES = {"token_rate": RateLimitType.TOKENS, "global_watermark": RateLimitType.TOKENS,
          "concurrency": RateLimitType.CONCURRENT_REQUESTS}  # fmt: skip


def refusal_error(
    a: AdmissionLike, *, tenant: str, request_id: str, model: str, limits: LimitsLike | None,
    unavailable_retry_after_ms: int,
) -> HTTPException:  # fmt: skip
    """The exception to raise from the pre-call hook for a refused request."""
    r = refusal_of(a, tenant=tenant, request_id=request_id, limits=limits,
                   unavailable_retry_after_ms=unavailable_retry_after_ms)  # fmt: skip
    if r.status == 429:
        return ProxyRateLimitError(
            detail=r.message, headers=r.headers,
            category=RateLimitErrorCategory.LITELLM_RATE_LIMIT,
            rate_limit_type=_TYPES.get(a.reason), model=model,
        )  # fmt: skip
    return HTTPException(status_code=r.status, detail=r.message, headers=r.headers)


def no_tenant_error(message: str) -> HTTPException:
    return HTTPException(status_code=403, detail=message, headers={REASON: "no_tenant"})


def bad_request_error(message: str) -> HTTPException:
    """An argument burstgate cannot take (the SDK's ValueError names it)."""
    return HTTPException(status_code=400, detail=message, headers={REASON: "invalid_argument"})

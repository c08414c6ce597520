"""The access log of the server's RPCs (logger ``burstgate.access``): one
line per operator call, admission calls sampled (``admission_log_sample``:
a log line costs more than the decision), one warning per refusal.

Keys and secrets are never logged; neither is any request payload beyond
ids and counts."""

from __future__ import annotations

import uuid
from typing import Any

import structlog

from controlplane.domain.keys import Principal
from controlplane.rpc.auth import Rule

log = structlog.get_logger("burstgate.access")

MAX_REQUEST_ID = 128


def request_id(metadata: Any) -> str:
    """The caller's ``x-request-id`` when it is a sane one, else a new id."""
    for item in metadata or ():
        if item[0] == "x-request-id":
            value = item[1] if isinstance(item[1], str) else item[1].decode("latin-1")
            if 0 < len(value) <= MAX_REQUEST_ID and value.isprintable():
                return value
            break
    return uuid.uuid4().hex[:16]


def tenant_of(request: Any) -> str:
    tenant = getattr(request, "tenant_id", None)
    if isinstance(tenant, str):
        return tenant
    nested = getattr(request, "tenant", None)
    value = getattr(nested, "tenant_id", "") if nested is not None else ""
    return value if isinstance(value, str) else ""


def admission_call(rule: Rule, code: str, seconds: float, request: Any, **extra: Any) -> None:
    """A sampled admission call (``request`` None for a stream)."""
    fields: dict[str, Any] = {}
    if request is not None:
        fields["tenant"] = tenant_of(request)
        rid = getattr(request, "request_id", "")
        if rid:
            fields["request_id"] = rid
    log.info(
        "rpc",
        service=rule.service,
        method=rule.method,
        code=code,
        duration_ms=round(seconds * 1000, 3),
        **fields,
        **extra,
    )


def operator_call(
    rule: Rule, code: str, seconds: float, rid: str, principal: Principal, request: Any
) -> None:
    log.info(
        "rpc",
        service=rule.service,
        method=rule.method,
        code=code,
        duration_ms=round(seconds * 1000, 3),
        request_id=rid,
        key_id=principal.key_id,
        role=principal.role.value,
        tenant=tenant_of(request),
    )


def refused(rule: Rule, code: str, reason: str) -> None:
    log.warning("rpc refused", service=rule.service, method=rule.method, code=code, reason=reason)


def stream_refused(rule: Rule, batches: int, error: str) -> None:
    log.warning(
        "stream refused", service=rule.service, method=rule.method, batches=batches, error=error
    )

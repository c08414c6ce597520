"""The SDK's answer types and their construction from the wire messages.

Everything a caller gets back is a frozen dataclass of plain values (no
protobuf), so a sidecar can log, compare and pass them around freely. The
``offline`` constructors build the answers the SDK gives on its own when the
control plane is unreachable (FailPolicy).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, make_dataclass
from enum import StrEnum
from typing import Any, cast

from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
from burstgate_client.redirects import NotOwner

__all__ = [
    "UNAVAILABLE",
    "Admission",
    "Completion",
    "ControlPlaneUnavailable",
    "FailPolicy",
    "Limits",
]

# Admission.reason when a fail-closed lane refuses because the control plane
# is unreachable (not a burstgate.v1.Reason: the server never said it).
UNAVAILABLE = "unavailable"

# burstgate.v1.Reason number -> its name without the prefix, lower case
# ("" for REASON_UNSPECIFIED, i.e. admitted).
REASON_NAMES: dict[int, str] = {
    number: ("" if number == pb.REASON_UNSPECIFIED else name.removeprefix("REASON_").lower())
    for name, number in pb.Reason.items()
}
QUOTA_REASONS = frozenset({"hourly_quota", "daily_quota"})


class ControlPlaneUnavailable(Exception):
    """The control plane is unreachable and the SDK cannot stand in for it:
    raised by ``complete`` when a Complete can be neither delivered nor
    buffered (the completion spool is full), so the caller knows this usage
    will not be billed unless it keeps it itself."""


class FailPolicy(StrEnum):
    """What an Admit gets when the control plane is unreachable, per lane."""

    OPEN = "open"  # admit locally (Admission.offline=True), settle later
    CLOSED = "closed"  # refuse (Admission.offline=True, reason="unavailable", retryable=True)


@dataclass(frozen=True, slots=True)
class Admission:
    request_id: str
    admitted: bool
    reason: str  # "" when admitted; a burstgate.v1.Reason name (lower case) or "unavailable"
    retry_after_ms: int
    retryable: bool
    granted_max_tokens: int
    reservation_id: int  # 0 when not admitted or offline
    degraded: bool
    max_tokens_cap: int  # 0 = no cap
    fallback_model: str  # "" = keep the model
    pricing_multiplier: str  # decimal text; "" when offline
    bucket_remaining: int
    hourly_remaining: int  # -1 = unlimited
    daily_remaining: int  # -1 = unlimited
    queue_wait_ms: int
    offline: bool  # decided by the SDK: the control plane was unreachable
    quota_exhausted: bool  # reason is hourly_quota or daily_quota
    # reason "not_owner" (several replicas, docs/ha.md): the owner's address
    # ("" while unknown). The client follows it itself; a caller sees this
    # only when the owner could not be reached within its hops.
    owner: str = ""
    # Admitted by the server: its signature over the admission (opaque), what
    # re-announcing the reservation to another replica needs (reannounce.py).
    admission_token: bytes = b""


# Admission's fields in a plain slots class. A frozen dataclass's __init__
# sets each field through object.__setattr__ (about 5x the cost of a plain
# one's, 19 fields); an instance of this twin, built by the plain __init__
# and given Admission as its class (the same slots, so the same layout), is
# an Admission like any other: equal, hashable, frozen from then on.
_Unfrozen = make_dataclass("_Unfrozen", [f.name for f in fields(Admission)], slots=True)


def _built(*values: Any) -> Admission:
    """An Admission of all 19 fields, positionally, built fast (see _Unfrozen)."""
    a = _Unfrozen(*values)
    a.__class__ = Admission
    return cast(Admission, a)


@dataclass(frozen=True, slots=True)
class Completion:
    request_id: str
    delivered: bool  # False: buffered, delivered later
    duplicate: bool
    user_charge: str  # "" when not delivered or metering off
    currency: str
    pricing_multiplier: str


@dataclass(frozen=True, slots=True)
class Limits:
    tenant_id: str
    token_rate: float  # tokens/s
    burst_tokens: int
    bucket_tokens: int
    bucket_full_in_ms: int
    max_concurrency: int  # -1 = unlimited
    inflight_requests: int
    hourly_quota: int
    hourly_remaining: int
    daily_quota: int
    daily_remaining: int
    hour_resets_in_ms: int
    day_resets_in_ms: int


def _admission(
    request_id: str, decision: int, reason: int, *, retry_after_ms: int, retryable: bool,
    granted: int, reservation_id: int, degradation: pb.Degradation | None, multiplier: str,
    bucket: int, hourly: int, daily: int, queue_wait_ms: int, token: bytes = b"",
) -> Admission:  # fmt: skip
    name = REASON_NAMES.get(reason, f"reason_{reason}")
    active = degradation is not None and degradation.active
    return Admission(
        request_id=request_id,
        admitted=decision == pb.DECISION_ADMIT,
        reason=name,
        retry_after_ms=retry_after_ms,
        retryable=retryable,
        granted_max_tokens=granted,
        reservation_id=reservation_id,
        degraded=active,
        max_tokens_cap=degradation.max_tokens_cap if degradation is not None and active else 0,
        fallback_model=degradation.fallback_model if degradation is not None and active else "",
        pricing_multiplier=multiplier,
        bucket_remaining=bucket,
        hourly_remaining=hourly,
        daily_remaining=daily,
        queue_wait_ms=queue_wait_ms,
        offline=False,
        quota_exhausted=name in QUOTA_REASONS,
        admission_token=token,
    )


def admission_of_response(resp: pb.AdmitResponse) -> Admission:
    """A unary AdmitResponse."""
    return _admission(
        resp.request_id, resp.decision, resp.reason, retry_after_ms=resp.retry_after_ms,
        retryable=resp.retryable, granted=resp.granted_max_tokens,
        reservation_id=resp.reservation_id,
        degradation=resp.degradation if resp.HasField("degradation") else None,
        multiplier=resp.pricing_multiplier, bucket=resp.remaining.bucket_tokens,
        hourly=resp.remaining.hourly_tokens, daily=resp.remaining.daily_tokens,
        queue_wait_ms=resp.queue_wait_ms, token=resp.admission_token,
    )  # fmt: skip


def _column(column: Sequence[int], n: int, default: int) -> list[int]:
    """A result's column as a list of ``n``, ``default`` where the server
    left it short (retryable, queued, queue_wait_ms are empty where they do
    not apply). One conversion per result: indexing a protobuf repeated
    field per element costs several times a list index."""
    out = list(column)
    return out if len(out) >= n else out + [default] * (n - len(out))


def _pick(column: list[Any], columns: Sequence[int], whole: bool) -> list[Any]:
    return column if whole else [column[k] for k in columns]


def admissions_of_result(
    res: pb.AdmitBatchResult, columns: Sequence[int], request_ids: Sequence[str]
) -> list[Admission]:
    """Columns ``columns`` of an AdmitBatchResult (a first result or a
    release), for the requests ``request_ids`` (one per column listed). The
    batch-wide degradation instructions apply where ``degraded[k]``.

    Column by column (each a list comprehension or a repeated default), then
    one ``map`` builds the answers: a Python loop body per entry costs more
    than the rest of the SDK's work for that entry."""
    n = len(res.decision)
    m = len(request_ids)
    if len(columns) != m:
        raise ValueError(f"{len(columns)} columns for {m} request ids")
    whole = m == n and all(k == i for i, k in enumerate(columns))
    reason = _pick(_column(res.reason, n, 0), columns, whole)
    if any(reason):
        names = [REASON_NAMES.get(r) or ("" if not r else f"reason_{r}") for r in reason]
        quota = [name in QUOTA_REASONS for name in names]
    else:
        names, quota = [""] * m, [False] * m
    admit = pb.DECISION_ADMIT
    admitted = [d == admit for d in _pick(list(res.decision), columns, whole)]
    retryable = [bool(r) for r in _pick(_column(res.retryable, n, 0), columns, whole)]
    g = res.degradation if res.HasField("degradation") and res.degradation.active else None
    if g is not None:
        # each degraded entry's own tenant's fallback model (servers before
        # the column: the batch-wide one, the first entry's tenant's)
        fallback = list(res.fallback_model) if len(res.fallback_model) == n else None
        degraded = [bool(d) for d in _pick(_column(res.degraded, n, 0), columns, whole)]
        caps = [g.max_tokens_cap if d else 0 for d in degraded]
        picked = _pick(fallback, columns, whole) if fallback is not None else None
        fallbacks = [
            (picked[i] if picked is not None else g.fallback_model) if d else ""
            for i, d in enumerate(degraded)
        ]
    else:
        degraded, caps, fallbacks = [False] * m, [0] * m, [""] * m
    owners = _pick(list(res.owner), columns, whole) if len(res.owner) == n else [""] * m
    tokens = (
        _pick(list(res.admission_token), columns, whole)
        if len(res.admission_token) == n
        else [b""] * m
    )
    out: list[Admission] = list(map(
        _built, request_ids, admitted, names,
        _pick(_column(res.retry_after_ms, n, 0), columns, whole), retryable,
        _pick(_column(res.granted_max_tokens, n, 0), columns, whole),
        _pick(_column(res.reservation_id, n, 0), columns, whole), degraded, caps, fallbacks,
        [res.pricing_multiplier] * m, _pick(_column(res.bucket_remaining, n, 0), columns, whole),
        _pick(_column(res.hourly_remaining, n, -1), columns, whole),
        _pick(_column(res.daily_remaining, n, -1), columns, whole),
        _pick(_column(res.queue_wait_ms, n, 0), columns, whole), [False] * m, quota, owners,
        tokens,
    ))  # fmt: skip
    return out


def offline_admission(
    request_id: str, policy: FailPolicy, max_tokens: int, retry_ms: int
) -> Admission:
    """The SDK's own answer while the control plane is unreachable: admitted
    as asked (fail open) or refused as retryable after ``retry_ms`` (fail
    closed). Remaining figures are unknown: 0 for the bucket, -1 (unlimited)
    for the quotas."""
    admitted = policy is FailPolicy.OPEN
    return Admission(
        request_id=request_id,
        admitted=admitted,
        reason="" if admitted else UNAVAILABLE,
        retry_after_ms=0 if admitted else max(1, retry_ms),
        retryable=not admitted,
        granted_max_tokens=max_tokens if admitted else 0,
        reservation_id=0,
        degraded=False,
        max_tokens_cap=0,
        fallback_model="",
        pricing_multiplier="",
        bucket_remaining=0,
        hourly_remaining=-1,
        daily_remaining=-1,
        queue_wait_ms=0,
        offline=True,
        quota_exhausted=False,
    )


def not_owner_admission(request_id: str, where: NotOwner) -> Admission:
    """A unary Admit answered NOT_OWNER: a retryable refusal naming the owner."""
    return Admission(
        request_id=request_id, admitted=False, reason="not_owner",
        retry_after_ms=round(where.retry_s * 1000), retryable=True, granted_max_tokens=0,
        reservation_id=0, degraded=False, max_tokens_cap=0, fallback_model="",
        pricing_multiplier="", bucket_remaining=0, hourly_remaining=-1, daily_remaining=-1,
        queue_wait_ms=0, offline=False, quota_exhausted=False, owner=where.owner,
    )  # fmt: skip


def gate_timeout_admission(request_id: str, waited_ms: int) -> Admission:
    """A request the server held in its queue (queued[i]) whose release did
    not come within the caller's deadline: refused as QUEUE_TIMEOUT would
    have refused it (the server was reachable and holding it, so the
    lane's FailPolicy does not apply). Its retry hint is the time it waited
    (at least 1 ms): the server's own hint never came, and 0 would invite an
    immediate retry into the queue that just held it (a client such as the
    sidecar then has a ``retry-after`` to give, as for the server's refusal)."""
    return Admission(
        request_id=request_id, admitted=False, reason="queue_timeout",
        retry_after_ms=max(1, waited_ms),
        retryable=True, granted_max_tokens=0, reservation_id=0, degraded=False,
        max_tokens_cap=0, fallback_model="", pricing_multiplier="", bucket_remaining=0,
        hourly_remaining=-1, daily_remaining=-1, queue_wait_ms=waited_ms, offline=False,
        quota_exhausted=False,
    )  # fmt: skip


def completion_of_response(resp: pb.CompleteResponse) -> Completion:
    return Completion(
        request_id=resp.request_id,
        delivered=True,
        duplicate=resp.duplicate,
        user_charge=resp.user_charge,
        currency=resp.currency,
        pricing_multiplier=resp.pricing_multiplier,
    )


def buffered_completion(request_id: str, *, duplicate: bool = False) -> Completion:
    return Completion(request_id, False, duplicate, "", "", "")


def limits_of(msg: pb.TenantLimits) -> Limits:
    return Limits(
        tenant_id=msg.tenant_id,
        token_rate=float(msg.token_rate or 0),
        burst_tokens=msg.burst_tokens,
        bucket_tokens=msg.bucket_tokens,
        bucket_full_in_ms=msg.bucket_full_in_ms,
        max_concurrency=msg.max_concurrency,
        inflight_requests=msg.inflight_requests,
        hourly_quota=msg.hourly_quota,
        hourly_remaining=msg.hourly_remaining,
        daily_quota=msg.daily_quota,
        daily_remaining=msg.daily_remaining,
        hour_resets_in_ms=msg.hour_resets_in_ms,
        day_resets_in_ms=msg.day_resets_in_ms,
    )

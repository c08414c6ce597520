"""Answers: a decided record stored, counted, and turned into what the caller
is told (``AdmitDecision`` for one request, ``BatchResult`` columns for a
batch)."""

from __future__ import annotations

from dataclasses import dataclass

from controlplane.domain import AdmitDecision, Decision, Degradation, Pressure
from controlplane.domain.units import PPM
from controlplane.service import records as R
from controlplane.service.pools import FRESH
from controlplane.service.records import Key, Record, RequestLog
from controlplane.service.signing import AdmissionSigner
from controlplane.service.stats import AdmissionStats
from controlplane.service.tenants import TenantDirectory
from fastpath import Reason

_OK = int(Reason.OK)

REASON_TEXT: dict[int, str] = {
    Reason.OK: "admitted",
    Reason.TOKEN_RATE: "token bucket short; retry after it refills",
    Reason.HOURLY_QUOTA: "hourly token quota exhausted until the next UTC hour",
    Reason.DAILY_QUOTA: "daily token quota exhausted until the next UTC day",
    Reason.CONCURRENCY: "too many requests in flight for this tenant",
    Reason.MAX_TOKENS: "request exceeds the tenant's per-request, burst or quota size",
    Reason.UNKNOWN_TENANT: "tenant_id is not configured",
    Reason.TENANT_DISABLED: "tenant is disabled",
    Reason.GLOBAL_WATERMARK: "all tenants' in-flight tokens are at the global safe level",
    Reason.BACKPRESSURE: "the engine pool is overloaded",
    Reason.QUEUE_TIMEOUT: "waited in the lane's queue until the max wait passed",
    Reason.QUEUE_FULL: "the queue is full",
    Reason.OPEN_RESERVATIONS: "the server holds its maximum of open reservations (memory cap)",
    Reason.NOT_OWNER: "another replica owns this pool's cell; resend it to the owner",
}


# Refusals that retrying as is can never cure: the request is too large for
# some limit, or the tenant is unknown or switched off. Every other refusal
# names a wait (a refill, a window, a slot, the pool) after which it may pass.
NOT_RETRYABLE = frozenset({Reason.MAX_TOKENS, Reason.UNKNOWN_TENANT, Reason.TENANT_DISABLED})


def retryable(reason: int) -> bool:
    """Whether a refusal for ``reason`` may pass when retried; a record
    flagged late (records.LATE_BIT) is not, whatever its reason."""
    return reason != _OK and reason not in NOT_RETRYABLE


@dataclass(slots=True)
class BatchResult:
    """Columns answering one AdmitStream message, index i answering request i."""

    decision: list[int]
    reason: list[int]
    retry_after_ms: list[int]
    reserved_tokens: list[int]
    reservation_id: list[int]
    granted_max_tokens: list[int]
    bucket_remaining: list[int]
    hourly_remaining: list[int]
    daily_remaining: list[int]
    duplicate: list[bool]
    shadow_reason: list[int]
    degraded: list[bool]
    pricing_multiplier: float = 1.0  # the batch's pool/model multiplier in force
    degradation: Degradation | None = None  # the pool's instructions, for entries degraded[i]
    pressure: Pressure | None = None  # the pool as the batch saw it
    retryable: list[bool] | None = None  # entry i: a refusal retrying may cure
    # entry i's admission token (signing.py), b"" when refused; None: none admitted
    admission_token: list[bytes] | None = None


class Outcomes:
    """Where every single decision ends: remembered in the request log (for
    idempotent replays and settlement), counted, and answered."""

    def __init__(
        self, log: RequestLog, stats: AdmissionStats, tenants: TenantDirectory,
        signer: AdmissionSigner,
    ) -> None:  # fmt: skip
        self._log = log
        self._stats = stats
        self._tenants = tenants
        self._signer = signer

    def record(self, key: Key, rec: Record) -> AdmitDecision:
        """Store and count a fresh decision; return its answer."""
        if rec[R.STATE] == R.OPEN:
            self._log.add_admitted(key, rec)
        else:
            self._log.add_rejected(key, rec)
        self._stats.count(rec)
        return self.answer(key, rec, duplicate=False)

    def answer(self, key: Key, rec: Record, *, duplicate: bool) -> AdmitDecision:
        policy = self._tenants.policy
        reason = rec[R.REASON]
        cap = rec[R.DEGRADED_CAP]
        freshness = rec[R.FRESHNESS]
        return AdmitDecision(
            request_id=key[1],
            decision=Decision.ADMIT if reason == _OK else Decision.REJECT,
            reason=Reason(reason),
            retry_after_ns=rec[R.RETRY_NS],
            reserved_tokens=rec[R.RESERVED],
            reservation_id=rec[R.RID],
            granted_max_tokens=rec[R.GRANTED],
            bucket_remaining=rec[R.BUCKET],
            hourly_remaining=rec[R.HOUR],
            daily_remaining=rec[R.DAY],
            lane=rec[R.LANE],
            message=REASON_TEXT[reason],
            duplicate=duplicate,
            pricing_multiplier=rec[R.MULTIPLIER],
            queue_wait_ns=rec[R.DECIDED_NS] - rec[R.ARRIVED_NS],
            degradation=None
            if not cap
            else Degradation(cap, policy.degrade_page_tokens, self._tenants.fallback_model(key[0])),
            shadow_reason=rec[R.SHADOW_REASON],
            pressure=Pressure(
                rec[R.SCORE_PPM] / PPM,
                freshness,
                "" if freshness == FRESH else policy.stale_policy,
                bool(rec[R.SHED] & R.SHED_BIT),
            ),
            retryable=retryable(reason) and not rec[R.SHED] & R.LATE_BIT,
            # signed on every answer, replays too (the same facts, the same
            # token): nothing is stored per request for it
            admission_token=self._signer.sign_record(key, rec) if reason == _OK else b"",
        )

"""burstgate.v1.AdmissionService: protobuf <-> AdmissionService."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, cast

import grpc

from controlplane._proto.burstgate.v1 import admission_pb2 as pb
from controlplane._proto.burstgate.v1 import admission_pb2_grpc as pb_grpc
from controlplane.domain import AdmitDecision, Degradation, Pressure
from controlplane.domain.errors import DomainError
from controlplane.domain.money import format_multiplier
from controlplane.domain.units import NS_PER_MS, NS_PER_S
from controlplane.domain.validate import check_exec_times
from controlplane.rpc.auth import admission_scope
from controlplane.rpc.errors import abort, error_status, unary_errors
from controlplane.service import AdmissionService
from controlplane.service.waiting import WaitingRoom

if TYPE_CHECKING:
    from controlplane.ledger.metering import Metering


def ceil_ms(ns: int) -> int:
    """Nanoseconds as whole milliseconds, rounded up, as the batch's
    retry_after_ms column is (controlplane/service/decider.py): a client
    that waits the answer's retry_after_ms is never early."""
    return -(-ns // NS_PER_MS)


# The service's stale policy names (domain Policy.stale_policy; "" = fresh)
# and the ledger's miss-rate sources, as their wire enums.
STALE_POLICY = {
    "": pb.STALE_POLICY_UNSPECIFIED,
    "fail_open": pb.STALE_POLICY_FAIL_OPEN,
    "fail_closed": pb.STALE_POLICY_FAIL_CLOSED,
}
MISS_RATE_SOURCE = {
    "request": pb.MISS_RATE_SOURCE_REQUEST,
    "window": pb.MISS_RATE_SOURCE_WINDOW,
    "none": pb.MISS_RATE_SOURCE_NONE,
}


def _pressure_pb(p: Pressure | None) -> pb.Pressure | None:
    if p is None:
        return None
    return pb.Pressure(
        score=p.score,
        freshness=pb.PoolFreshness.ValueType(p.freshness),
        stale_policy=STALE_POLICY[p.stale_policy],
        shed=p.shed,
    )


def _degradation_pb(g: Degradation | None) -> pb.Degradation | None:
    if g is None:
        return None
    return pb.Degradation(
        active=True,
        max_tokens_cap=g.max_tokens_cap,
        page_after_tokens=g.page_after_tokens,
        fallback_model=g.fallback_model,
    )


def decision_to_pb(d: AdmitDecision) -> pb.AdmitResponse:
    return pb.AdmitResponse(
        request_id=d.request_id,
        decision=pb.Decision.ValueType(d.decision),
        reason=pb.Reason.ValueType(d.reason),
        retry_after_ms=ceil_ms(d.retry_after_ns),
        reserved_tokens=d.reserved_tokens,
        reservation_id=d.reservation_id,
        granted_max_tokens=d.granted_max_tokens,
        remaining=pb.Remaining(
            bucket_tokens=d.bucket_remaining,
            hourly_tokens=d.hourly_remaining,
            daily_tokens=d.daily_remaining,
        ),
        message=d.message,
        duplicate=d.duplicate,
        lane=d.lane,
        pricing_multiplier=format_multiplier(d.pricing_multiplier),
        retryable=d.retryable,
        queue_wait_ms=ceil_ms(d.queue_wait_ns),
        degradation=_degradation_pb(d.degradation),
        shadow_reason=pb.Reason.ValueType(d.shadow_reason),
        pressure=_pressure_pb(d.pressure),
    )


class AdmissionServicer(pb_grpc.AdmissionServiceServicer):
    """``metering``: Complete is recorded in the ledger before it is
    answered; None = settle in memory only."""

    def __init__(
        self,
        service: AdmissionService,
        waiting: WaitingRoom | None = None,
        *,
        metering: Metering | None = None,
    ) -> None:
        self._svc = service
        self._waiting = waiting or WaitingRoom(service)
        self.metering = metering

    @unary_errors
    async def Admit(
        self, request: pb.AdmitRequest, context: grpc.aio.ServicerContext
    ) -> pb.AdmitResponse:
        # A scoped sidecar key: the tenant here, the pool the request is
        # sent to in the service (which resolves it).
        scope = admission_scope.get()
        if scope is not None:
            scope.check_tenant("tenant_id", request.tenant_id)
        # May wait server-side in the lane's queue (bounded by the lane's wait
        # target, the tenant's max wait and this call's deadline).
        d = await self._waiting.admit(
            request.tenant_id,
            request.request_id,
            request.lane,
            request.prompt_tokens,
            request.max_tokens,
            request.model,
            request.pool,
            timeout_s=context.time_remaining(),
            scope=scope,
        )
        return decision_to_pb(d)

    @unary_errors
    async def Complete(
        self, request: pb.CompleteRequest, context: grpc.aio.ServicerContext
    ) -> pb.CompleteResponse:
        scope = admission_scope.get()
        if scope is not None:
            scope.check_tenant("tenant_id", request.tenant_id)
            pool = self._svc.reservation_pool(request.tenant_id, request.request_id)
            scope.check_pool("pool", pool, "the reservation's pool")
        # With metering the reply waits until the ledger record is
        # durable; without it the settlement is in memory only.
        svc = self._svc
        check_exec_times(
            request.exec_start_unix_ns,
            request.exec_end_unix_ns,
            svc.clock(),
            int(svc.settings.reservation_ttl_s * NS_PER_S),
        )
        metering = self.metering
        if metering is None:
            s = self._svc.complete(
                request.tenant_id,
                request.request_id,
                request.reservation_id,
                request.prompt_tokens,
                request.generated_tokens,
                request.cached_prompt_tokens,
                request.kv_cache_miss_rate,
            )
            self._waiting.reschedule()  # a settlement may have admitted waiters
            return pb.CompleteResponse(
                request_id=s.request_id,
                reserved_tokens=s.reserved_tokens,
                actual_tokens=s.actual_tokens,
                refunded_tokens=s.refunded_tokens,
                duplicate=s.duplicate,
            )
        r = await metering.complete(
            request.tenant_id,
            request.request_id,
            request.reservation_id,
            request.prompt_tokens,
            request.generated_tokens,
            request.cached_prompt_tokens,
            request.kv_cache_miss_rate,
            miss_rate_reported=True if request.kv_cache_miss_rate_reported else None,
            exec_start_ns=request.exec_start_unix_ns,
            exec_end_ns=request.exec_end_unix_ns,
        )
        if not r.duplicate:
            self._waiting.reschedule()  # a settlement may have admitted waiters
        s = r.settlement
        resp = pb.CompleteResponse(
            request_id=s.request_id,
            reserved_tokens=s.reserved_tokens,
            actual_tokens=s.actual_tokens,
            refunded_tokens=s.refunded_tokens,
            duplicate=r.duplicate,
        )
        if r.record is not None:
            from controlplane.domain.money import format_fixed, format_nanos

            rec = r.record
            resp.user_charge = format_nanos(rec.user_charge_nanos)
            resp.actual_cost = format_nanos(rec.actual_cost_nanos)
            resp.currency = rec.currency
            resp.pricing_multiplier = format_fixed(rec.pricing_multiplier, 6)
            resp.pricing_window = rec.pricing_window
            resp.lane_multiplier = format_fixed(rec.lane_multiplier, 6)
            resp.kv_cache_miss_rate = float(rec.kv_cache_miss_rate)
            resp.miss_rate_source = MISS_RATE_SOURCE[rec.miss_rate_source]
        return resp

    async def AdmitStream(
        self,
        request_iterator: AsyncIterator[pb.AdmitBatch],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.AdmitBatchResult]:
        # A bad batch ends the stream with INVALID_ARGUMENT naming
        # field[index] after a "batch N: " prefix (README, "Errors");
        # batches answered before it stand. So does an entry outside a
        # scoped key's tenants or pools, with PERMISSION_DENIED: nothing of
        # that batch is decided.
        scope = admission_scope.get()
        async for batch in request_iterator:
            try:
                # list() once: indexing a protobuf repeated field per element
                # costs several times a list index.
                tenant_ids = list(batch.tenant_id)
                if scope is not None:
                    scope.check_tenants("tenant_id", tenant_ids)
                r = self._svc.admit_batch(
                    tenant_ids,
                    list(batch.request_id),
                    list(batch.lane),
                    list(batch.prompt_tokens),
                    list(batch.max_tokens),
                    batch.model,
                    batch.pool,
                    scope=scope,
                )
            except DomainError as exc:
                status = error_status(
                    exc, prefix=f"batch {batch.batch_id}: ", batch_id=str(batch.batch_id)
                )
                await abort(context, status)
            yield pb.AdmitBatchResult(
                batch_id=batch.batch_id,
                # the columns hold the enum numbers already
                decision=cast("list[pb.Decision.ValueType]", r.decision),
                reason=cast("list[pb.Reason.ValueType]", r.reason),
                retry_after_ms=r.retry_after_ms,
                reserved_tokens=r.reserved_tokens,
                reservation_id=r.reservation_id,
                granted_max_tokens=r.granted_max_tokens,
                bucket_remaining=r.bucket_remaining,
                hourly_remaining=r.hourly_remaining,
                daily_remaining=r.daily_remaining,
                duplicate=r.duplicate,
                pricing_multiplier=format_multiplier(r.pricing_multiplier),
                retryable=r.retryable or [],
                shadow_reason=cast("list[pb.Reason.ValueType]", r.shadow_reason),
                degraded=r.degraded,
                degradation=_degradation_pb(r.degradation),
                pressure=_pressure_pb(r.pressure),
            )

    @unary_errors
    async def ReportLoad(
        self, request: pb.LoadReport, context: grpc.aio.ServicerContext
    ) -> pb.LoadReportAck:
        scope = admission_scope.get()
        if scope is not None:
            scope.check_pool("pool", request.pool)
        n = self._svc.report_load(
            request.pool,
            request.engine_id,
            request.batch_tokens,
            request.max_batch_tokens,
            request.queue_depth,
            request.queue_capacity,
            _optional(request, "kv_cache_miss_rate"),
            request.gpu_utilization,
            requests_running=_optional(request, "requests_running"),
            max_num_seqs=_optional(request, "max_num_seqs"),
            kv_cache_usage=_optional(request, "kv_cache_usage"),
        )
        self._waiting.reschedule()
        load, evict_below = self._svc.eviction_advice(request.pool)
        return pb.LoadReportAck(
            pool=request.pool, engines_reporting=n, load=load, evict_below_reuse_per_s=evict_below
        )


def _optional(message: Any, name: str) -> Any:
    """An optional (explicit-presence) field's value, None when unset."""
    return getattr(message, name) if message.HasField(name) else None

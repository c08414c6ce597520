"""burstgate.v1.AdmissionService: protobuf <-> AdmissionService."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc
from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
from burstgate_client._proto.burstgate.v1 import admission_pb2_grpc as pb_grpc

from controlplane.domain import MAX_ID_LEN, AdmitDecision
from controlplane.domain.money import format_multiplier
from controlplane.domain.scope import KeyScope
from controlplane.domain.units import NS_PER_S
from controlplane.domain.validate import check_exec_times, check_optional_name, check_pool
from controlplane.rpc.admitstream import Batch, admit_stream
from controlplane.rpc.auth import admission_scope
from controlplane.rpc.convert import (
    MISS_RATE_SOURCE,
    STALE_POLICY,
    ceil_ms,
    degradation_msg,
)
from controlplane.rpc.errors import unary_errors
from controlplane.rpc.owners import cell_owners, ensure_shares, redirect_if_not_owner
from controlplane.rpc.reannounce import reannounce
from controlplane.service import AdmissionService
from controlplane.service.edge import check_admit
from controlplane.service.waiting import WaitingRoom

if TYPE_CHECKING:
    from controlplane.ha.serving import Ownership
    from controlplane.ledger.metering import Metering


def decision_to_pb(d: AdmitDecision) -> pb.AdmitResponse:
    """The wire answer of one decision. Fields are set one by one, and only
    when they differ from their default (a proto3 scalar at its default is
    not sent either way): half the cost of the keyword constructor, which
    copies each nested message passed to it. ``remaining`` and ``pressure``
    are present even when all their fields are zero, as before."""
    r = _Response()
    r.request_id = d.request_id
    if d.decision:
        r.decision = d.decision  # type: ignore[assignment]  # (an int enum)
    if d.reason:
        r.reason = d.reason  # type: ignore[assignment]  # (an int enum)
    if d.retry_after_ns:
        r.retry_after_ms = ceil_ms(d.retry_after_ns)
    if d.reserved_tokens:
        r.reserved_tokens = d.reserved_tokens
    if d.reservation_id:
        r.reservation_id = d.reservation_id
    if d.granted_max_tokens:
        r.granted_max_tokens = d.granted_max_tokens
    rem = r.remaining
    rem.SetInParent()
    if d.bucket_remaining:
        rem.bucket_tokens = d.bucket_remaining
    if d.hourly_remaining:
        rem.hourly_tokens = d.hourly_remaining
    if d.daily_remaining:
        rem.daily_tokens = d.daily_remaining
    if d.message:
        r.message = d.message
    if d.duplicate:
        r.duplicate = True
    if d.lane:
        r.lane = d.lane
    r.pricing_multiplier = format_multiplier(d.pricing_multiplier)
    if d.retryable:
        r.retryable = True
    if d.queue_wait_ns:
        r.queue_wait_ms = ceil_ms(d.queue_wait_ns)
    g = d.degradation
    if g is not None:
        r.degradation.CopyFrom(degradation_msg(g))
    if d.shadow_reason:
        r.shadow_reason = d.shadow_reason  # type: ignore[assignment]  # (an int enum)
    p = d.pressure
    if p is not None:
        pr = r.pressure
        pr.SetInParent()
        pr.score = p.score  # (a -0.0 is sent: no test for zero here)
        if p.freshness:
            pr.freshness = p.freshness  # type: ignore[assignment]  # (an int enum)
        policy = STALE_POLICY[p.stale_policy]
        if policy:
            pr.stale_policy = policy
        if p.shed:
            pr.shed = True
    if d.admission_token:
        r.admission_token = d.admission_token
    return r


_Response = pb.AdmitResponse


class AdmissionServicer(pb_grpc.AdmissionServiceServicer):
    """``metering``: Complete is recorded in the ledger before it is
    answered; None = settle in memory only."""

    def __init__(
        self,
        service: AdmissionService,
        waiting: WaitingRoom | None = None,
        *,
        metering: Metering | None = None,
        ownership: Ownership | None = None,
    ) -> None:
        """``ownership``: several replicas (docs/ha.md): calls for a pool whose
        cell another replica owns are redirected there (rpc/owners.py)."""
        self._svc = service
        self._waiting = waiting or WaitingRoom(service)
        self.metering = metering
        self.ownership = ownership

    @unary_errors
    async def Admit(
        self, request: pb.AdmitRequest, context: grpc.aio.ServicerContext
    ) -> pb.AdmitResponse:
        # A scoped sidecar key: the tenant here, the pool the request is
        # sent to in the service (which resolves it).
        scope = admission_scope.get()
        if scope is not None:
            scope.check_tenant("tenant_id", request.tenant_id)
        route = None  # computed once: the owner check's is the decision's
        if self.ownership is not None and not self.ownership.local:
            route = self._svc.replicas.route(
                request.tenant_id, request.lane, request.prompt_tokens, request.max_tokens,
                request.pool,
            )  # fmt: skip
            pool = request.pool or ("" if route is None else route.pool)
            if scope is not None:  # a key outside the pool claims nothing for it
                scope.check_pool("pool", pool, "this request's pool")
            await redirect_if_not_owner(self.ownership, pool, context)
            # a share of the tenant's limits here (several replicas); bad
            # input is refused first, having asked for nothing
            left = context.time_remaining()
            await ensure_shares(
                self.ownership, self._svc, (request.tenant_id,),
                None if left is None else left / 2,
                check=lambda: check_admit(
                    request.tenant_id, request.request_id, request.prompt_tokens,
                    request.max_tokens, request.model, request.pool, request.lane,
                ),
            )  # fmt: skip
        # May wait server-side in the lane's queue (bounded by the lane's wait
        # target, the tenant's max wait and this call's deadline).
        waiting = self._waiting
        out = waiting.decide(
            request.tenant_id,
            request.request_id,
            request.lane,
            request.prompt_tokens,
            request.max_tokens,
            request.model,
            request.pool,
            timeout_s=context.time_remaining(),
            scope=scope,
            retry_key=request.retry_key,
            attempt=request.attempt,
            route=route,
        )
        # (an immediate answer awaits nothing: no coroutine, no future)
        d = out if isinstance(out, AdmitDecision) else await waiting.wait(out)
        return decision_to_pb(d)

    @unary_errors
    async def Complete(
        self, request: pb.CompleteRequest, context: grpc.aio.ServicerContext
    ) -> pb.CompleteResponse:
        scope = admission_scope.get()
        if scope is not None:
            scope.check_tenant("tenant_id", request.tenant_id)
        svc = self._svc
        if request.pool:  # the owner of the pool's cell settles it (docs/ha.md)
            check_pool(request.pool)
            if scope is not None:  # a key outside the pool claims nothing for it
                scope.check_pool("pool", request.pool)
            # An undeclared pool is refused (the route's check), unless the
            # reservation is remembered here in that very pool (admitted
            # before the pool's declaration was withdrawn): it settles here,
            # so no record of work done is lost to a config change.
            if (
                request.pool in svc.views.declared_pools()
                or svc.replicas.reservation_pool(request.tenant_id, request.request_id)
                != request.pool
            ):
                svc.replicas.check_pool(request.pool)
                await redirect_if_not_owner(self.ownership, request.pool, context)
        check_exec_times(
            request.exec_start_unix_ns,
            request.exec_end_unix_ns,
            svc.clock(),
            int(svc.limits.reservation_ttl_s * NS_PER_S),
            first_ns=request.first_token_unix_ns,
        )
        check_optional_name("correlation_id", request.correlation_id, max_len=MAX_ID_LEN)
        booked = request.HasField("offline") and await self._book_offline(request, scope)
        if scope is not None:
            pool = self._svc.replicas.reservation_pool(request.tenant_id, request.request_id)
            scope.check_pool("pool", pool, "the reservation's pool")
        # With metering the reply waits until the ledger record is
        # durable; without it the settlement is in memory only.
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
                first_token_ns=request.first_token_unix_ns,
            )
            self._waiting.reschedule()  # a settlement may have admitted waiters
            return pb.CompleteResponse(
                request_id=s.request_id,
                reserved_tokens=s.reserved_tokens,
                actual_tokens=s.actual_tokens,
                refunded_tokens=s.refunded_tokens,
                duplicate=s.duplicate,
                offline_booked=booked,
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
            first_token_ns=request.first_token_unix_ns,
            correlation_id=request.correlation_id,
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
            offline_booked=booked,
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

    async def _book_offline(self, request: pb.CompleteRequest, scope: KeyScope | None) -> bool:
        """A request a sidecar admitted while this server was unreachable:
        book it (AdmissionService.book_offline) unless the ledger already
        has it (billed by an earlier delivery whose answer was lost)."""
        off, svc = request.offline, self._svc
        args = (
            request.tenant_id, request.request_id, off.lane, off.model, off.pool,
            request.prompt_tokens, request.generated_tokens, request.cached_prompt_tokens,
            request.kv_cache_miss_rate, request.reservation_id,
        )  # fmt: skip
        if self.metering is not None:
            svc.offline.check(*args)  # (bad input never reaches the ledger's lookup)
            key = (request.tenant_id, request.request_id)
            if svc.views.record(*key) is None and await self.metering.find(key) is not None:
                return False
        return svc.offline.book(*args, now=svc.clock(), scope=scope)

    # Registered bytes to bytes (rpc/assembly.py): batches come as columns
    # (fastpath.AdmitBatchColumns), results leave as bytes or messages.
    wire_admit_stream = True

    async def AdmitStream(  # type: ignore[override]
        self,
        request_iterator: AsyncIterator[Batch],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[bytes | pb.AdmitBatchResult]:
        # A bad batch ends the stream with INVALID_ARGUMENT naming
        # field[index] after a "batch N: " prefix (docs/api.md, "Errors");
        # batches answered before it stand. So does an entry outside a
        # scoped key's tenants or pools, with PERMISSION_DENIED: nothing of
        # that batch is decided. Entries that may wait: admitstream.py.
        async for res in admit_stream(
            self._svc,
            self._waiting,
            admission_scope.get(),
            request_iterator,
            context,
            self.ownership,
        ):
            yield res

    @unary_errors
    async def ReportLoad(
        self, request: pb.LoadReport, context: grpc.aio.ServicerContext
    ) -> pb.LoadReportAck:
        scope = admission_scope.get()
        if scope is not None:
            scope.check_pool("pool", request.pool)
        await redirect_if_not_owner(self.ownership, request.pool, context)
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
        load, evict_below = self._svc.views.eviction_advice(request.pool)
        return pb.LoadReportAck(
            pool=request.pool, engines_reporting=n, load=load, evict_below_reuse_per_s=evict_below
        )

    @unary_errors
    async def GetLimits(
        self, request: pb.GetLimitsRequest, context: grpc.aio.ServicerContext
    ) -> pb.TenantLimits:
        scope = admission_scope.get()
        if scope is not None:
            scope.check_tenant("tenant_id", request.tenant_id)
        t = self._svc.views.tenant_limits(request.tenant_id)
        return pb.TenantLimits(
            tenant_id=t.tenant_id,
            token_rate=format(t.token_rate.normalize(), "f"),
            burst_tokens=t.burst_tokens,
            bucket_tokens=t.bucket_tokens,
            bucket_full_in_ms=t.bucket_full_in_ms,
            hourly_quota=t.hourly_quota,
            hourly_remaining=t.hourly_remaining,
            daily_quota=t.daily_quota,
            daily_remaining=t.daily_remaining,
            max_concurrency=t.max_concurrency,
            inflight_requests=t.inflight_requests,
            hour_resets_in_ms=t.hour_resets_in_ms,
            day_resets_in_ms=t.day_resets_in_ms,
        )

    @unary_errors
    async def Reannounce(
        self, request: pb.ReannounceRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReannounceResponse:
        # a sidecar's open reservations, for the new owner of their pools
        # (rpc/reannounce.py); the auth and scope rules are Complete's
        return await reannounce(self._svc, self.ownership, admission_scope.get(), request)

    @unary_errors
    async def GetCellOwners(
        self, request: pb.GetCellOwnersRequest, context: grpc.aio.ServicerContext
    ) -> pb.CellOwners:
        from controlplane.ha.serving import Ownership

        if request.pool:
            check_pool(request.pool)
            scope = admission_scope.get()
            if scope is not None:  # a scoped key asks about its own pools
                scope.check_pool("pool", request.pool)
        return cell_owners(self.ownership or Ownership(None), request.pool)


def _optional(message: Any, name: str) -> Any:
    """An optional (explicit-presence) field's value, None when unset."""
    return getattr(message, name) if message.HasField(name) else None

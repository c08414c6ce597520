"""burstgate.v1.AdmissionService: protobuf <-> AdmissionService."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import cast

import grpc
from google.protobuf.duration_pb2 import Duration

from controlplane._proto.burstgate.v1 import admission_pb2 as pb
from controlplane._proto.burstgate.v1 import admission_pb2_grpc as pb_grpc
from controlplane.domain import AdmitDecision
from controlplane.errors import DomainError
from controlplane.rpc.errors import status_for, unary_errors
from controlplane.service import AdmissionService

NS_PER_S = 1_000_000_000


def decision_to_pb(d: AdmitDecision) -> pb.AdmitResponse:
    secs, nanos = divmod(d.retry_after_ns, NS_PER_S)
    return pb.AdmitResponse(
        request_id=d.request_id,
        decision=pb.Decision.ValueType(d.decision),
        reason=pb.Reason.ValueType(d.reason),
        retry_after=Duration(seconds=secs, nanos=nanos),
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
        pricing_multiplier=d.pricing_multiplier,
    )


class AdmissionServicer(pb_grpc.AdmissionServiceServicer):
    def __init__(self, service: AdmissionService) -> None:
        self._svc = service

    @unary_errors
    async def Admit(
        self, request: pb.AdmitRequest, context: grpc.aio.ServicerContext
    ) -> pb.AdmitResponse:
        d = self._svc.admit(
            request.tenant_id,
            request.request_id,
            request.lane,
            request.prompt_tokens,
            request.max_tokens,
            request.model,
            request.pool,
        )
        return decision_to_pb(d)

    @unary_errors
    async def Complete(
        self, request: pb.CompleteRequest, context: grpc.aio.ServicerContext
    ) -> pb.CompleteResponse:
        s = self._svc.complete(
            request.tenant_id,
            request.request_id,
            request.reservation_id,
            request.prompt_tokens,
            request.generated_tokens,
            request.cached_prompt_tokens,
            request.kv_cache_miss_rate,
        )
        return pb.CompleteResponse(
            request_id=s.request_id,
            reserved_tokens=s.reserved_tokens,
            actual_tokens=s.actual_tokens,
            refunded_tokens=s.refunded_tokens,
            duplicate=s.duplicate,
        )

    async def AdmitStream(
        self,
        request_iterator: AsyncIterator[pb.AdmitBatch],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.AdmitBatchResult]:
        # A bad batch ends the stream with INVALID_ARGUMENT naming
        # field[index]; batches answered before it stand.
        async for batch in request_iterator:
            try:
                # list() once: indexing a protobuf repeated field per element
                # costs several times a list index.
                r = self._svc.admit_batch(
                    list(batch.tenant_id),
                    list(batch.request_id),
                    list(batch.lane),
                    list(batch.prompt_tokens),
                    list(batch.max_tokens),
                    batch.model,
                    batch.pool,
                )
            except DomainError as exc:
                await context.abort(status_for(exc), f"batch {batch.batch_id}: {exc}")
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
                pricing_multiplier=r.pricing_multiplier,
            )

    @unary_errors
    async def ReportLoad(
        self, request: pb.LoadReport, context: grpc.aio.ServicerContext
    ) -> pb.LoadReportAck:
        n = self._svc.report_load(
            request.pool,
            request.engine_id,
            request.batch_tokens,
            request.max_batch_tokens,
            request.queue_depth,
            request.queue_capacity,
            request.kv_cache_miss_rate,
            request.gpu_utilization,
        )
        return pb.LoadReportAck(pool=request.pool, engines_reporting=n)

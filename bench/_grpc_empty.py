"""The "empty" AdmissionService used as the baseline in bench_grpc.py.

Same proto, same generated (de)serializers, same server construction
(``controlplane.rpc.assembly.create_server`` with its options, health and
reflection), same grpc.aio + uvloop stack -- but the handlers decide nothing:
``Admit`` returns one pre-built ``AdmitResponse`` and ``AdmitStream`` answers
every ``AdmitBatch`` with a pre-built ``AdmitBatchResult`` of the same length,
whose values look like burstgate's (mostly admitted, unlimited quotas) so the
reply is about as many bytes on the wire as the real one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any
from unittest import mock

from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
from burstgate_client._proto.burstgate.v1 import admission_pb2_grpc as pb_grpc

import controlplane.rpc.assembly as server_mod
from controlplane.service import AdmissionService

# A refusal on every REFUSE_EVERY-th row, as the load generator's tight
# tenant gets (see _loadgen.TENANT_CYCLE).
REFUSE_EVERY = 10
_BUCKET_LEFT = 999_000_000_000  # tokens: a burst of 10^12 a little used


def prebuilt_result(n: int) -> pb.AdmitBatchResult:
    """A plausible answer to a batch of ``n`` requests."""
    admit = [(i + 1) % REFUSE_EVERY != 0 for i in range(n)]
    return pb.AdmitBatchResult(
        decision=[pb.DECISION_ADMIT if a else pb.DECISION_REJECT for a in admit],
        reason=[pb.REASON_UNSPECIFIED if a else pb.REASON_TOKEN_RATE for a in admit],
        retry_after_ms=[0 if a else 37 for a in admit],
        reserved_tokens=[150 if a else 0 for a in admit],
        reservation_id=[1_000_000 + i if a else 0 for i, a in enumerate(admit)],
        granted_max_tokens=[50 if a else 0 for a in admit],
        bucket_remaining=[_BUCKET_LEFT - i if a else 0 for i, a in enumerate(admit)],
        hourly_remaining=[-1] * n,
        daily_remaining=[-1] * n,
        duplicate=[False] * n,
    )


def prebuilt_response() -> pb.AdmitResponse:
    return pb.AdmitResponse(
        request_id="u-00000000-standard",
        decision=pb.DECISION_ADMIT,
        reason=pb.REASON_UNSPECIFIED,
        retry_after_ms=0,
        reserved_tokens=150,
        reservation_id=1_000_000,
        granted_max_tokens=50,
        remaining=pb.Remaining(bucket_tokens=_BUCKET_LEFT, hourly_tokens=-1, daily_tokens=-1),
        message="admitted",
        duplicate=False,
        lane="standard",
    )


class EmptyAdmissionServicer(pb_grpc.AdmissionServiceServicer):
    """Answers without deciding. Takes (and ignores) the service, waiting,
    metering and ownership arguments so it can stand in for
    ``controlplane.rpc.admission.AdmissionServicer``."""

    def __init__(
        self,
        _service: object = None,
        _waiting: object = None,
        batch_sizes: Sequence[int] = (100, 1000),
        *,
        metering: object = None,
        ownership: object = None,
    ) -> None:
        self._response = prebuilt_response()
        self._results: dict[int, pb.AdmitBatchResult] = {n: prebuilt_result(n) for n in batch_sizes}

    async def Admit(self, request: pb.AdmitRequest, context: Any) -> pb.AdmitResponse:
        return self._response

    async def Complete(self, request: pb.CompleteRequest, context: Any) -> pb.CompleteResponse:
        return pb.CompleteResponse(request_id=request.request_id)

    async def ReportLoad(self, request: pb.LoadReport, context: Any) -> pb.LoadReportAck:
        return pb.LoadReportAck(pool=request.pool)

    async def AdmitStream(
        self, request_iterator: AsyncIterator[pb.AdmitBatch], context: Any
    ) -> AsyncIterator[pb.AdmitBatchResult]:
        results = self._results
        async for batch in request_iterator:
            n = len(batch.tenant_id)
            result = results.get(n)
            if result is None:
                result = results[n] = prebuilt_result(n)
            yield result


def create_empty_server(service: AdmissionService, address: str = "127.0.0.1:0") -> tuple[Any, int]:
    """``controlplane.rpc.assembly.create_server`` itself, with the real servicer
    swapped for :class:`EmptyAdmissionServicer` -- so options, health and
    reflection are exactly the production ones. Returns (server, port);
    the server is not started."""
    with mock.patch.object(server_mod, "AdmissionServicer", EmptyAdmissionServicer):
        server, port, _health = server_mod.create_server(service, address)
    return server, port

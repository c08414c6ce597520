"""A small synchronous client for sidecars, tests and benchmarks.

with AdmissionClient("127.0.0.1:50051") as c:
    d = c.admit("acme", "req-1", prompt_tokens=900, max_tokens=256)
    if d.decision == pb.DECISION_ADMIT:
        ...  # run the request, then
        c.complete("acme", "req-1", prompt_tokens=900, generated_tokens=120)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from types import TracebackType

import grpc

from controlplane._proto.burstgate.v1 import admission_pb2 as pb
from controlplane._proto.burstgate.v1 import admission_pb2_grpc as pb_grpc

__all__ = ["KEEPALIVE_OPTIONS", "AdmissionClient", "pb"]

# Keepalive within the server's policy (README "Keepalive"): ping after 10 s
# without traffic (Go's and Java's floor, 20x what the server tolerates) and
# give the connection up when the ack takes over 5 s, so an AdmitStream to a
# vanished server fails in ~15 s rather than at the OS's TCP timeout. Also
# with no call open, and on a stream that sends nothing for a while: grpc
# core's client otherwise sends 2 pings and then none until it sends data.
KEEPALIVE_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


class AdmissionClient:
    def __init__(self, target: str, *, timeout: float | None = 5.0) -> None:
        self.channel = grpc.insecure_channel(target, options=KEEPALIVE_OPTIONS)
        self.stub = pb_grpc.AdmissionServiceStub(self.channel)
        self.timeout = timeout

    def __enter__(self) -> AdmissionClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def admit(
        self,
        tenant_id: str,
        request_id: str,
        *,
        prompt_tokens: int,
        max_tokens: int,
        lane: str = "",
        model: str = "",
        pool: str = "",
    ) -> pb.AdmitResponse:
        resp: pb.AdmitResponse = self.stub.Admit(
            pb.AdmitRequest(
                tenant_id=tenant_id,
                request_id=request_id,
                lane=lane,
                prompt_tokens=prompt_tokens,
                max_tokens=max_tokens,
                model=model,
                pool=pool,
            ),
            timeout=self.timeout,
        )
        return resp

    def complete(
        self,
        tenant_id: str,
        request_id: str,
        *,
        prompt_tokens: int,
        generated_tokens: int,
        cached_prompt_tokens: int = 0,
        reservation_id: int = 0,
        kv_cache_miss_rate: float = 0.0,
    ) -> pb.CompleteResponse:
        resp: pb.CompleteResponse = self.stub.Complete(
            pb.CompleteRequest(
                tenant_id=tenant_id,
                request_id=request_id,
                reservation_id=reservation_id,
                prompt_tokens=prompt_tokens,
                generated_tokens=generated_tokens,
                cached_prompt_tokens=cached_prompt_tokens,
                kv_cache_miss_rate=kv_cache_miss_rate,
            ),
            timeout=self.timeout,
        )
        return resp

    def report_load(self, report: pb.LoadReport) -> pb.LoadReportAck:
        ack: pb.LoadReportAck = self.stub.ReportLoad(report, timeout=self.timeout)
        return ack

    def admit_stream(self, batches: Iterable[pb.AdmitBatch]) -> Iterator[pb.AdmitBatchResult]:
        """Send batches on one AdmitStream; yields one result per batch, in order."""
        results: Iterator[pb.AdmitBatchResult] = self.stub.AdmitStream(iter(batches))
        return results


def make_batch(
    batch_id: int,
    tenant_ids: Sequence[str],
    request_ids: Sequence[str],
    prompt_tokens: Sequence[int],
    max_tokens: Sequence[int],
    *,
    lanes: Sequence[str] = (),
    model: str = "",
    pool: str = "",
) -> pb.AdmitBatch:
    return pb.AdmitBatch(
        batch_id=batch_id,
        tenant_id=tenant_ids,
        request_id=request_ids,
        lane=lanes,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        model=model,
        pool=pool,
    )

"""``ProtoClient``: a thin synchronous client that sends and returns the
API's protobuf messages, for tests, benchmarks and tools. Applications and
sidecars use the SDK (``burstgate_client.sdk.AdmissionClient``): argument
checks, batching, deadlines, a breaker and a spool.

with ProtoClient("127.0.0.1:50051") as c:
    d = c.admit("acme", "req-1", prompt_tokens=900, max_tokens=256)
    if d.decision == pb.DECISION_ADMIT:
        ...  # run the request, then
        c.complete("acme", "req-1", prompt_tokens=900, generated_tokens=120)

Several replicas (docs/ha.md): give one or more seed addresses
("cp-0:50051,cp-1:50051", or a list). A replica that does not own the
request's pool answers NOT_OWNER with the owner's address; the client keeps
a channel per replica, caches the owner per pool and resends there (at most
``MAX_HOPS`` times; request ids make the resend idempotent). ``complete``
with ``pool`` goes to that pool's owner. ``admit_stream`` uses the first seed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from types import TracebackType
from typing import TypeVar

import grpc

from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
from burstgate_client._proto.burstgate.v1 import admission_pb2_grpc as pb_grpc
from burstgate_client.redirects import MAX_HOPS, not_owner, owner_address, targets

R = TypeVar("R")

__all__ = ["KEEPALIVE_OPTIONS", "ProtoClient", "pb"]

# Keepalive within the server's policy (docs/api.md, "Keepalive"): ping after 10 s
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


class ProtoClient:
    def __init__(self, target: str | Sequence[str], *, timeout: float | None = 5.0) -> None:
        self.seeds = targets(target)
        self.timeout = timeout
        self._channels: dict[str, grpc.Channel] = {}
        self._stubs: dict[str, pb_grpc.AdmissionServiceStub] = {}
        self.owners: dict[str, str] = {}  # pool -> owner address, as last learned
        self.redirects = 0  # NOT_OWNER answers followed
        self.stub = self._stub(self.seeds[0])
        self.channel = self._channels[self.seeds[0]]

    def _stub(self, address: str) -> pb_grpc.AdmissionServiceStub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = grpc.insecure_channel(address, options=KEEPALIVE_OPTIONS)
            self._channels[address] = channel
            stub = self._stubs[address] = pb_grpc.AdmissionServiceStub(channel)
        return stub

    def _routed(self, key: str, call: Callable[[pb_grpc.AdmissionServiceStub], R]) -> R:
        """``call`` on the cached owner of ``key`` (a pool; "" = unknown: the
        first seed), following NOT_OWNER answers at most MAX_HOPS times."""
        address = self.owners.get(key, self.seeds[0])
        for hop in range(MAX_HOPS + 1):
            try:
                return call(self._stub(address))
            except grpc.RpcError as exc:
                where = not_owner(exc)
                if where is None or hop == MAX_HOPS:
                    raise
                self.redirects += 1
                pool = where.pool or key
                if where.owner:
                    address = self.owners[pool] = where.owner
                else:  # not known yet: ask any replica, then wait the hint
                    self.owners.pop(pool, None)
                    address = self._owner_of(pool) or self.seeds[(hop + 1) % len(self.seeds)]
                    time.sleep(where.retry_s)
        raise AssertionError("unreachable")

    def _owner_of(self, pool: str) -> str:
        for seed in self.seeds:
            try:
                owners = self._stub(seed).GetCellOwners(
                    pb.GetCellOwnersRequest(pool=pool), timeout=self.timeout
                )
            except grpc.RpcError:
                continue
            if address := owner_address(owners):
                self.owners[pool] = address
                return address
        return ""

    def cell_owners(self, pool: str = "") -> pb.CellOwners:
        """GetCellOwners on the first seed."""
        owners: pb.CellOwners = self.stub.GetCellOwners(
            pb.GetCellOwnersRequest(pool=pool), timeout=self.timeout
        )
        return owners

    def __enter__(self) -> ProtoClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()

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
        req = pb.AdmitRequest(
            tenant_id=tenant_id,
            request_id=request_id,
            lane=lane,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            model=model,
            pool=pool,
        )
        resp: pb.AdmitResponse = self._routed(pool, lambda s: s.Admit(req, timeout=self.timeout))
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
        pool: str = "",
    ) -> pb.CompleteResponse:
        """``pool``: the pool it was admitted to; set, the Complete goes to
        (and is settled by) that pool's owner."""
        req = pb.CompleteRequest(
            tenant_id=tenant_id,
            request_id=request_id,
            reservation_id=reservation_id,
            prompt_tokens=prompt_tokens,
            generated_tokens=generated_tokens,
            cached_prompt_tokens=cached_prompt_tokens,
            kv_cache_miss_rate=kv_cache_miss_rate,
            pool=pool,
        )
        resp: pb.CompleteResponse = self._routed(
            pool, lambda s: s.Complete(req, timeout=self.timeout)
        )
        return resp

    def report_load(self, report: pb.LoadReport) -> pb.LoadReportAck:
        ack: pb.LoadReportAck = self._routed(
            report.pool, lambda s: s.ReportLoad(report, timeout=self.timeout)
        )
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

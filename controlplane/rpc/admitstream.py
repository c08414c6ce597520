"""AdmitStream: batches in, results out, and (for batches whose entries may
wait, AdmitBatch.max_wait_ms) *release* results for the entries a queue
held, sent as they are released.

Two tasks per stream: the reader decides each batch as it arrives and puts
its result on the stream's outbox; the handler's generator writes the outbox
out. A held entry's Waiter calls back into the stream's ``Releases`` when it
is resolved; the first release since the last write puts a marker on the
outbox, and the writer sends every release ready by then, one result per
batch. So the first result of a batch always precedes its releases (it is
put on the outbox before the Waiter can be resolved: deciding is
synchronous), and releases that land in one dispatch go out together.

A stream that ends early (cancelled, failed, a bad batch) takes its
still-queued entries out of the queues; the half-closed stream of a client
that sent its last batch stays open until every queued entry is answered.

Bytes to bytes: the method is registered with :data:`deserialize` and
:func:`serialize` in place of the generated (de)serializers (rpc/assembly.py),
so a batch arrives as columns (``fastpath.read_batch``: no protobuf message,
equal tenant ids one str) and the common answer, a batch decided at once,
leaves as the wire bytes ``fastpath.write_result`` writes from the service's
columns. The rare answers (waiting entries' first and release results,
batches with NOT_OWNER entries) are still built as protobuf messages and
serialized by the runtime: their cost is per entry that waits or is
redirected, not per decision of the fast path.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, cast

import grpc
import structlog
from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb

from controlplane.domain import AdmitDecision, Decision
from controlplane.domain.errors import DomainError
from controlplane.domain.money import format_multiplier
from controlplane.domain.scope import KeyScope
from controlplane.ha.serving import Ownership, Redirect
from controlplane.rpc import owners
from controlplane.rpc.convert import (
    STALE_POLICY,
    ceil_ms,
    degradation_msg,
    degradation_pb,
    pressure_msg,
    pressure_pb,
)
from controlplane.rpc.errors import abort, error_status, internal_status
from controlplane.service import AdmissionService
from controlplane.service.answers import BatchResult
from controlplane.service.queueing import Waiter
from controlplane.service.waiting import WaitingRoom
from fastpath import AdmitBatchColumns, read_batch, write_result

log = structlog.get_logger("burstgate.rpc")

_READ_DONE = object()  # the client half-closed (or the reader stopped)
_RELEASES = object()  # releases are ready to be written


Batch = AdmitBatchColumns | pb.AdmitBatch  # the latter: a subset (owners.subset)
# The method's request deserializer: raises on bytes that are no AdmitBatch
# (the request guard turns that into INVALID_ARGUMENT, rpc/guard.py).
deserialize = read_batch
MESSAGE_TYPE = pb.AdmitBatch.DESCRIPTOR.full_name


def serialize(res: bytes | pb.AdmitBatchResult) -> bytes:
    """The method's response serializer: bytes written already, or a message."""
    return res if res.__class__ is bytes else cast("pb.AdmitBatchResult", res).SerializeToString()


def _col(column: Sequence[Any]) -> list[Any]:
    """A column as a list: the reader's lists as they are (one per batch,
    owned by it), a protobuf repeated field copied (indexing one costs
    several times a list index)."""
    return column if isinstance(column, list) else list(column)


class _Fail:
    """The reader met a bad batch (or a bug): end the stream with ``status``;
    or the request iterator itself ended the call (``aborted``: a malformed
    message, refused by the guard), to be raised again by the writer."""

    def __init__(
        self, status: grpc.Status | None, aborted: grpc.aio.AbortError | None = None
    ) -> None:
        self.status, self.aborted = status, aborted


Outbox = asyncio.Queue[object]


class Releases:
    """The queued entries of one stream and the answers ready to be sent."""

    def __init__(self, outbox: Outbox) -> None:
        self._outbox = outbox
        self.held: dict[int, Waiter] = {}  # id(waiter) -> waiter, while it waits
        # batch_id -> [(entry index, decision)], answers not yet written
        self.ready: dict[int, list[tuple[int, AdmitDecision]]] = {}

    def hold(self, batch_id: int, index: int, waiter: Waiter) -> None:
        self.held[id(waiter)] = waiter
        waiter.on_done = self._on_done(batch_id, index, id(waiter))

    def _on_done(self, batch_id: int, index: int, key: int) -> Callable[[AdmitDecision], None]:
        def done(decision: AdmitDecision) -> None:
            if self.held.pop(key, None) is None:
                return  # the stream ended meanwhile (its waiters were cancelled)
            if not self.ready:
                self._outbox.put_nowait(_RELEASES)
            self.ready.setdefault(batch_id, []).append((index, decision))

        return done

    def take(self) -> list[pb.AdmitBatchResult]:
        out = [release_result(b, answers) for b, answers in self.ready.items()]
        self.ready = {}
        return out

    @property
    def owed(self) -> bool:
        """Entries still waiting, or answered and not yet written."""
        return bool(self.held or self.ready)


def batch_result(
    batch_id: int, r: BatchResult, fallback: Callable[[str], str], tenant_ids: list[str]
) -> pb.AdmitBatchResult:
    """``fallback``: a tenant's fallback model, for the degraded entries."""
    res = pb.AdmitBatchResult(
        batch_id=batch_id,
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
        degradation=degradation_pb(r.degradation),
        pressure=pressure_pb(r.pressure),
    )
    if r.admission_token is not None:
        res.admission_token.extend(r.admission_token)
    if r.degradation is not None and any(r.degraded):
        res.fallback_model.extend(
            fallback(t) if d else "" for t, d in zip(tenant_ids, r.degraded, strict=True)
        )
    return res


def batch_result_bytes(
    batch_id: int, r: BatchResult, fallback: Callable[[str], str], tenant_ids: list[str]
) -> bytes:
    """:func:`batch_result`'s message as wire bytes, written from the columns
    without building it (the property tests hold the two to the byte)."""
    g, p = r.degradation, r.pressure
    degraded = r.degraded
    fallbacks: Sequence[str] = ()
    if g is not None and any(degraded):
        fallbacks = [fallback(t) if d else "" for t, d in zip(tenant_ids, degraded, strict=True)]
    return write_result(
        batch_id, r.decision, r.reason, r.retry_after_ms, r.reserved_tokens, r.reservation_id,
        r.granted_max_tokens, r.bucket_remaining, r.hourly_remaining, r.daily_remaining,
        r.duplicate, r.shadow_reason, degraded,
        None if g is None else (True, g.max_tokens_cap, g.page_after_tokens, g.fallback_model),
        None if p is None else (p.score, p.freshness, STALE_POLICY[p.stale_policy], p.shed),
        format_multiplier(r.pricing_multiplier), r.retryable or (), (), (), (), fallbacks, (),
        r.admission_token or (),
    )  # fmt: skip


def _append(res: pb.AdmitBatchResult, decisions: list[AdmitDecision | None]) -> None:
    """One column entry per decision; None (an entry still queued) gets a
    placeholder: DECISION_UNSPECIFIED and zeros."""
    if any(d is not None and d.admission_token for d in decisions):
        res.admission_token.extend(
            d.admission_token if d is not None else b"" for d in decisions
        )
    for d in decisions:
        if d is None:
            _append_queued(res)
            continue
        res.decision.append(pb.Decision.ValueType(d.decision))
        res.reason.append(pb.Reason.ValueType(d.reason))
        res.retry_after_ms.append(ceil_ms(d.retry_after_ns))
        res.reserved_tokens.append(d.reserved_tokens)
        res.reservation_id.append(d.reservation_id)
        res.granted_max_tokens.append(d.granted_max_tokens)
        res.bucket_remaining.append(d.bucket_remaining)
        res.hourly_remaining.append(d.hourly_remaining)
        res.daily_remaining.append(d.daily_remaining)
        res.duplicate.append(d.duplicate)
        res.shadow_reason.append(pb.Reason.ValueType(d.shadow_reason))
        res.degraded.append(d.degradation is not None)
        res.retryable.append(d.retryable)
    if any(d is not None and d.degradation is not None for d in decisions):
        res.fallback_model.extend(
            d.degradation.fallback_model if d is not None and d.degradation is not None else ""
            for d in decisions
        )


_COLUMNS = owners.RESULT_COLUMNS


def _append_queued(res: pb.AdmitBatchResult) -> None:
    for name in _COLUMNS:
        getattr(res, name).append(0)


def _batch_wide(res: pb.AdmitBatchResult, decisions: list[AdmitDecision]) -> None:
    """The batch-wide fields: the first admitted entry's pool's (else the
    first entry's) multiplier and pressure; the degradation of the first
    degraded entry."""
    first = next((d for d in decisions if d.decision == Decision.ADMIT), None)
    first = first or (decisions[0] if decisions else None)
    if first is None:
        return
    res.pricing_multiplier = format_multiplier(first.pricing_multiplier)
    g = next((d.degradation for d in decisions if d.degradation is not None), None)
    if g is not None:
        res.degradation.CopyFrom(degradation_msg(g))
    if first.pressure is not None:
        res.pressure.CopyFrom(pressure_msg(first.pressure))


def waiting_result(
    batch_id: int, outs: list[AdmitDecision | Waiter], releases: Releases
) -> pb.AdmitBatchResult:
    """The first result of a batch that may wait: decided entries answered,
    held ones marked ``queued`` and handed to ``releases``."""
    decided: list[AdmitDecision | None] = []
    for i, out in enumerate(outs):
        if isinstance(out, Waiter) and out.done and isinstance(out.result, AdmitDecision):
            out = out.result  # decided at once after all
        if isinstance(out, Waiter):
            releases.hold(batch_id, i, out)
            decided.append(None)
        else:
            decided.append(out)
    res = pb.AdmitBatchResult(batch_id=batch_id, queued=[d is None for d in decided])
    _append(res, decided)
    _batch_wide(res, [d for d in decided if d is not None])
    return res


def release_result(batch_id: int, answers: list[tuple[int, AdmitDecision]]) -> pb.AdmitBatchResult:
    res = pb.AdmitBatchResult(batch_id=batch_id, entry=[i for i, _ in answers])
    decisions = [d for _, d in answers]
    _append(res, list(decisions))
    _batch_wide(res, decisions)
    res.queue_wait_ms.extend(ceil_ms(d.queue_wait_ns) for d in decisions)
    return res


async def admit_stream(
    svc: AdmissionService,
    waiting: WaitingRoom,
    scope: KeyScope | None,
    request_iterator: AsyncIterator[Batch],
    context: grpc.aio.ServicerContext,
    ownership: Ownership | None = None,
) -> AsyncIterator[bytes | pb.AdmitBatchResult]:
    outbox: Outbox = asyncio.Queue()
    releases = Releases(outbox)

    async def read() -> None:
        try:
            async for batch in request_iterator:
                res: bytes | pb.AdmitBatchResult
                try:
                    refused = await owners.batch_redirects(ownership, svc, batch, scope)
                    # never waits: a batch held here would hold up the stream
                    await owners.ensure_shares(ownership, svc, batch.tenant_id if not refused else
                                               [t for i, t in enumerate(batch.tenant_id)
                                                if i not in refused], wait=False)  # fmt: skip
                    if refused:
                        res = _decide_some(svc, waiting, scope, batch, releases, refused)
                    else:
                        res = _decide(svc, waiting, scope, batch, releases)
                    outbox.put_nowait(res)
                except DomainError as exc:
                    status = error_status(
                        exc, prefix=f"batch {batch.batch_id}: ", batch_id=str(batch.batch_id)
                    )
                    outbox.put_nowait(_Fail(status))
                    return
        except asyncio.CancelledError:
            raise
        except grpc.aio.AbortError as exc:
            outbox.put_nowait(_Fail(None, exc))
        except Exception:
            log.exception("unhandled error", method="AdmitStream")
            outbox.put_nowait(_Fail(internal_status()))
        finally:
            outbox.put_nowait(_READ_DONE)

    reader = asyncio.create_task(read())
    try:
        reading = True
        while reading or releases.owed:
            item = await outbox.get()
            if item is _READ_DONE:
                reading = False
            elif item is _RELEASES:
                for res in releases.take():
                    yield res
            elif isinstance(item, _Fail):
                if item.aborted is not None:
                    raise item.aborted
                assert item.status is not None
                await abort(context, item.status)
            else:
                yield cast("bytes | pb.AdmitBatchResult", item)
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await reader
        for w in list(releases.held.values()):
            svc.cancel(w)  # nobody will hear its answer: out of the queue
        releases.held.clear()
        waiting.reschedule()


def _decide(
    svc: AdmissionService,
    waiting: WaitingRoom,
    scope: KeyScope | None,
    batch: Batch,
    releases: Releases,
) -> bytes | pb.AdmitBatchResult:
    if not batch.max_wait_ms:
        tenant_ids, r = _decide_now(svc, scope, batch)
        return batch_result_bytes(batch.batch_id, r, svc.views.fallback_model, tenant_ids)
    res = waiting_result(batch.batch_id, _waiting_outs(svc, scope, batch), releases)
    waiting.reschedule()
    return res


def _decide_now(
    svc: AdmissionService, scope: KeyScope | None, batch: Batch
) -> tuple[list[str], BatchResult]:
    """A batch none of whose entries may wait, decided: its tenant column and
    the answer's columns."""
    tenant_ids = _col(batch.tenant_id)
    if scope is not None:
        scope.check_tenants("tenant_id", tenant_ids)
    r = svc.batches.admit(
        tenant_ids, _col(batch.request_id), _col(batch.lane), _col(batch.prompt_tokens),
        _col(batch.max_tokens), batch.model, batch.pool, scope=scope,
        retry_keys=_col(batch.retry_key), attempts=_col(batch.attempt),
    )  # fmt: skip
    return tenant_ids, r


def _decide_some(
    svc: AdmissionService,
    waiting: WaitingRoom,
    scope: KeyScope | None,
    batch: Batch,
    releases: Releases,
    refused: dict[int, Redirect],
) -> pb.AdmitBatchResult:
    """A batch some of whose entries another replica owns (docs/ha.md): those
    are refused NOT_OWNER in their places, the others decided as usual."""
    n = len(batch.tenant_id)
    request_ids = list(batch.request_id)
    keep = [i for i in range(n) if i not in refused]
    sub = owners.subset(batch, keep)
    if batch.max_wait_ms:
        outs = iter(_waiting_outs(svc, scope, sub) if keep else [])
        full: list[AdmitDecision | Waiter] = [
            owners.refusal(request_ids[i], refused[i]) if i in refused else next(outs)
            for i in range(n)
        ]
        res = waiting_result(batch.batch_id, full, releases)
        waiting.reschedule()
    elif keep:
        tenant_ids, r = _decide_now(svc, scope, sub)
        decided = batch_result(sub.batch_id, r, svc.views.fallback_model, tenant_ids)
        res = owners.expand(decided, n, keep, refused)
    else:
        res = pb.AdmitBatchResult(batch_id=batch.batch_id)
        _append(res, [owners.refusal(request_ids[i], refused[i]) for i in range(n)])
    owners.add_owner_column(res, n, refused)
    return res


def _waiting_outs(
    svc: AdmissionService, scope: KeyScope | None, batch: Batch
) -> list[AdmitDecision | Waiter]:
    tenant_ids = _col(batch.tenant_id)
    if scope is not None:
        scope.check_tenants("tenant_id", tenant_ids)
    return svc.batches.admit_waiting(
        tenant_ids, _col(batch.request_id), _col(batch.lane), _col(batch.prompt_tokens),
        _col(batch.max_tokens), _col(batch.max_wait_ms), batch.model, batch.pool, scope=scope,
        retry_keys=_col(batch.retry_key), attempts=_col(batch.attempt),
    )  # fmt: skip

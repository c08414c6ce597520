"""The asyncio client: :class:`AsyncAdmissionClient`.

One gRPC channel (keepalive as ``burstgate_client.protoclient.KEEPALIVE_OPTIONS``,
reconnect backoff capped, see breaker.py), one AdmitStream for the
micro-batched Admits (batcher.py), unary calls for the rest, a circuit
breaker that makes an unreachable control plane cheap, and the completion
spool (spool.py).

Deadlines: ``deadline_s`` (default 0.25 s) bounds a whole call, including
the time an Admit waits in burstgate's queue; an Admit asks the server to
hold it at most that long less a margin (batcher.wait_ms).

Offline admissions: a request admitted under fail-open is remembered
(lane, model, pool, when) until its ``complete``, which then carries
CompleteRequest.offline so the server books it. Every admitted request is
remembered the same way (bounded, oldest forgotten first): a Complete that
has to be buffered carries ``offline`` too, and a direct one the server
answers NOT_FOUND (its reservation was lost to a control-plane restart, or
expired) is sent once more with it. The server ignores ``offline`` where it
still holds the reservation and books the usage where it does not (with
metering, never twice: it checks the ledger), so a request that ran is
billed even when the control plane forgot it.

Several replicas (docs/ha.md): ``target`` may name several control-plane
addresses ("cp-0:50051,cp-1:50051", or a list). The client keeps a channel,
breaker and AdmitStream per replica it meets, caches each pool's owner, and
follows NOT_OWNER answers (unary error or per-entry reason) to the owner, at
most ``MAX_HOPS`` resends; a replica that is unreachable is skipped for
another one that is up. A Complete goes to the replica that admitted the
request (with its pool, when the caller named one, so a replica that is not
the owner redirects it); one that never saw the reservation answers
NOT_FOUND: the reservation is re-announced to it first (a Complete can
overtake the hand-over), and only if it does not take it does the resend
with ``offline`` book it once (replicas.py).
Before a call for a pool goes to a replica other than the one holding the
pool's open admissions (its owner changed), they are re-announced to it
(reannounce.py), so the new owner counts them and refunds their Completes.

Errors: bad arguments raise ValueError naming the argument (also the
server's INVALID_ARGUMENT, as its message says: "lane: unknown lane ...").
An unreachable control plane never raises from ``admit`` (FailPolicy) or
``complete`` (buffered), except a full spool (ControlPlaneUnavailable). Any
other failed call (UNAUTHENTICATED, PERMISSION_DENIED, NOT_FOUND, ...)
raises its ``grpc.aio.AioRpcError``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

import grpc

from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
from burstgate_client._proto.burstgate.v1 import admission_pb2_grpc as pb_grpc
from burstgate_client.admin import TlsFiles
from burstgate_client.redirects import MAX_HOPS, targets
from burstgate_client.sdk.batcher import Batcher
from burstgate_client.sdk.breaker import CHANNEL_OPTIONS, TRANSPORT_CODES, Breaker
from burstgate_client.sdk.checks import (
    check_admit_args,
    check_complete_args,
    check_deadline,
    check_window,
)
from burstgate_client.sdk.counters import Counters
from burstgate_client.sdk.entries import Entry
from burstgate_client.sdk.limits import LimitsCache
from burstgate_client.sdk.model import (
    Admission,
    Completion,
    ControlPlaneUnavailable,
    FailPolicy,
    Limits,
    buffered_completion,
    completion_of_response,
)
from burstgate_client.sdk.reannounce import Admitted, OpenAdmissions, Reannouncer
from burstgate_client.sdk.replicas import Replica, Replicas, routing_key
from burstgate_client.sdk.spool import CompletionSpool, offline_refused
from burstgate_client.sdk.spoolfile import SpoolFile

log = logging.getLogger("burstgate.sdk")

API_KEY_ENV = "BURSTGATE_API_KEY"
MAX_BATCH = 10_000  # the server's default most entries per AdmitBatch
# How long concurrent Admits may be held to share an AdmitBatch while one is
# in flight (a lone caller is never held: batcher.py).
BATCH_WINDOW_S = 0.0002


def make_channel(target: str, tls: TlsFiles | None) -> grpc.aio.Channel:
    """The client's channel: plaintext, or TLS / mTLS with ``tls``'s PEM files
    (as burstgate_client.admin's), with the SDK's channel options."""
    if tls is None or (tls.ca is None and tls.cert is None):
        return grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
    creds = grpc.ssl_channel_credentials(
        root_certificates=tls.ca.read_bytes() if tls.ca else None,
        private_key=tls.key.read_bytes() if tls.key else None,
        certificate_chain=tls.cert.read_bytes() if tls.cert else None,
    )
    options: list[tuple[str, int | str]] = list(CHANNEL_OPTIONS)
    if tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return grpc.aio.secure_channel(target, creds, options=options)


def fail_policies(value: FailPolicy | Mapping[str, FailPolicy]) -> dict[str, FailPolicy]:
    """The per-lane policies; key "" is the default (fail closed unless given)."""
    raw = {"": value} if isinstance(value, str) else dict(value)
    out = {"": FailPolicy.CLOSED}
    for lane, policy in raw.items():
        try:
            out[lane] = FailPolicy(policy)
        except ValueError:
            raise ValueError(
                f"fail_policy: {policy!r} for lane {lane!r} is not one of open, closed"
            ) from None
    return out


class AsyncAdmissionClient:
    def __init__(
        self, target: str | Sequence[str], *, api_key: str | None = None, deadline_s: float = 0.25,
        batch_window_s: float = BATCH_WINDOW_S, batch_max: int = 256,
        fail_policy: FailPolicy | Mapping[str, FailPolicy] = FailPolicy.CLOSED,
        spool_path: str | Path | None = None, spool_max: int = 100_000,
        limits_ttl_s: float = 5.0, connect_timeout_s: float = 1.0,
        complete_deadline_s: float = 2.0, wait_in_gate: bool = True,
        tls: TlsFiles | None = None,
    ) -> None:  # fmt: skip
        """Create inside a running event loop (the channel is bound to it).
        ``complete_deadline_s``: Complete is off the request's critical path
        and, with metering, answered once its ledger record is durable, so
        it gets longer than ``deadline_s``; a Complete past it is buffered.
        ``wait_in_gate=False``: Admits are never held in burstgate's queue
        (refused at once instead; the server's cheaper path), for callers
        that back off themselves. ``batch_window_s`` (default 200 µs, 0 to
        never hold): how long concurrent Admits may be held to share one
        AdmitBatch while another is in flight (a lone Admit is sent at
        once; batcher.py); ``batch_max``: the most Admits per AdmitBatch.
        ``tls``: the CA (and for mTLS the client's
        certificate and key) when the control plane serves TLS; None: plaintext."""
        self.deadline_s = check_deadline("deadline_s", deadline_s)
        self.complete_deadline_s = check_deadline("complete_deadline_s", complete_deadline_s)
        batch_window_s = check_window(batch_window_s)
        if isinstance(batch_max, bool) or not 1 <= batch_max <= MAX_BATCH:
            raise ValueError(f"batch_max: must be between 1 and {MAX_BATCH}, got {batch_max}")
        if isinstance(spool_max, bool) or spool_max < 1:
            raise ValueError(f"spool_max: must be >= 1, got {spool_max}")
        connect_timeout_s = check_deadline("connect_timeout_s", connect_timeout_s)
        if not limits_ttl_s >= 0:
            raise ValueError(f"limits_ttl_s: must be >= 0, got {limits_ttl_s}")
        seeds = targets(target)
        self._policies = fail_policies(fail_policy)
        # (everything checked before the channel exists: a bad argument leaks nothing)
        key = os.environ.get(API_KEY_ENV, "") if api_key is None else api_key
        self._meta = (("authorization", f"Bearer {key}"),) if key else None
        self.counters = Counters()

        def replica(address: str) -> Replica:
            channel = make_channel(address, tls)
            stub = pb_grpc.AdmissionServiceStub(channel)
            breaker = Breaker(channel, self.counters)
            batcher = Batcher(
                stub, self._meta, breaker, self.counters, self.policy_of,
                self._release, window_s=batch_window_s, batch_max=batch_max,
                connect_timeout_s=connect_timeout_s, wait_in_gate=wait_in_gate,
            )  # fmt: skip
            return Replica(address, channel, stub, breaker, batcher)

        self._replicas = Replicas(seeds, replica, self.counters, self._meta)
        home = self._replicas.home  # GetLimits, and what one replica alone used
        self._channel, self._stub = home.channel, home.stub
        self._breaker, self._batcher = home.breaker, home.batcher
        self._admitted = OpenAdmissions(max(spool_max, 10_000))
        self._reannouncer = Reannouncer(
            self._admitted, self._send_reannounce, self.counters,
            lambda address: not self._replicas.get(address).breaker.up,
        )  # fmt: skip
        self._replicas.on_moved = self._moved
        file = SpoolFile(spool_path) if spool_path is not None else None
        self._spool = CompletionSpool(
            self._send_complete, self._replicas.any_up, self.counters,  # type: ignore[arg-type]
            max_items=spool_max, file=file,
        )  # fmt: skip
        self._spool.load()
        self._limits = LimitsCache(
            self._stub, self._meta, self._breaker, self.counters, ttl_s=limits_ttl_s
        )
        self._closed = False

    async def __aenter__(self) -> AsyncAdmissionClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:  # fmt: skip
        await self.aclose()

    async def aclose(self, flush_timeout_s: float = 1.0) -> None:
        """Answer the Admits in flight, try to deliver the buffered Completes
        for up to ``flush_timeout_s`` (what is left stays in the spool file,
        when there is one), and close the channel."""
        if self._closed:
            return
        self._closed = True
        await self._reannouncer.aclose()
        for r in self._replicas.all():
            await r.batcher.aclose()
        if self._spool.pending and self._replicas.any_up.up:
            await self._spool.flush(flush_timeout_s)
        await self._spool.aclose()
        await self._replicas.aclose()

    @property
    def up(self) -> bool:
        """Whether the control plane (any replica) is considered reachable now."""
        return self._replicas.any_up.up

    @property
    def owners(self) -> dict[str, str]:
        """The owner address learned per pool (several replicas)."""
        return dict(self._replicas.owners)

    def policy_of(self, lane: str) -> FailPolicy:
        return self._policies.get(lane, self._policies[""])

    # ---------------------------------------------------------------- Admit

    async def admit(
        self, tenant_id: str, request_id: str, *, prompt_tokens: int, max_tokens: int,
        lane: str = "", model: str = "", pool: str = "", deadline_s: float | None = None,
        retry_key: str = "", attempt: int = 0,
    ) -> Admission:  # fmt: skip
        """Ask to admit one request. ``retry_key`` and ``attempt``: a retry
        of a refused request (``attempt`` 1, 2, ...) under the key its first
        attempt used is judged against that attempt's deadline
        (docs/gate.md); "" / 0 for a request that is nobody's retry."""
        if self._closed:
            raise RuntimeError("the client is closed")
        check_admit_args(tenant_id, request_id, prompt_tokens, max_tokens, lane, model, pool,
                         retry_key, attempt)  # fmt: skip
        d = self.deadline_s if deadline_s is None else check_deadline("deadline_s", deadline_s)
        deadline = self._batcher.now() + d
        a, where = await self._admit_routed(
            tenant_id, request_id, lane, prompt_tokens, max_tokens, model, pool, deadline,
            retry_key, attempt,
        )  # fmt: skip
        self.counters.admits += 1
        if a.admitted:
            self._admitted.add((tenant_id, request_id), Admitted(
                lane, model, pool, a.offline, time.time_ns(), "" if a.offline else where,
                routing_key(pool, tenant_id, lane), prompt_tokens, max_tokens,
                prompt_tokens + a.granted_max_tokens, a.granted_max_tokens, a.reservation_id,
                a.pricing_multiplier, a.admission_token,
            ))  # fmt: skip
        return a

    async def _admit_routed(
        self, tenant_id: str, request_id: str, lane: str, prompt_tokens: int, max_tokens: int,
        model: str, pool: str, deadline: float, retry_key: str = "", attempt: int = 0,
    ) -> tuple[Admission, str]:  # fmt: skip
        """Admit on the owner of the request's pool (several replicas):
        follow NOT_OWNER, and fail over from an unreachable replica to one
        that is up, at most MAX_HOPS times; the answer and who gave it."""
        replicas = self._replicas
        key = routing_key(pool, tenant_id, lane)
        r = replicas.for_key(key)
        tried: set[str] = set()
        for hop in range(MAX_HOPS + 1):
            if self._reannouncer.needed(key, r.address):  # the pool's owner changed
                await self._reannouncer.before(key, r.address, deadline - r.batcher.now())
            e = Entry(tenant_id, request_id, lane, prompt_tokens, max_tokens, model, pool,
                      deadline, retry_key, attempt)  # fmt: skip
            a = await r.batcher.admit(e, max(0.0, deadline - r.batcher.now()))
            last = hop == MAX_HOPS or r.batcher.now() >= deadline
            if a.reason == "not_owner" and not last:
                self.counters.redirects += 1
                address = a.owner or await replicas.discover(pool, {r.address})
                if address:
                    replicas.owners[key] = address
                    r = replicas.get(address)
                    continue
                replicas.owners.pop(key, None)
                await asyncio.sleep(min(a.retry_after_ms / 1000, deadline - r.batcher.now()))
                r = replicas.first_up() or r
                continue
            if a.offline and not last and len(replicas.seeds) > 1:
                tried.add(r.address)
                replicas.owners.pop(key, None)
                nxt = replicas.first_up(tried)
                if nxt is not None:  # another replica is up: it redirects or decides
                    self.counters.failovers += 1
                    r = nxt
                    continue
            if not a.offline and a.reason != "not_owner":
                replicas.owners[key] = r.address
            return a, r.address
        raise AssertionError("unreachable")

    def _release(self, e: Entry) -> None:
        """The server admitted ``e`` after its caller was refused (or left):
        settle it with no usage rather than hold its tokens until the TTL.
        Through the spool, in the background: late admissions come in
        numbers when the control plane is overloaded, and a Complete each,
        at once, would only add to that."""
        # with its pool: on several replicas the pool's owner holds it
        req = pb.CompleteRequest(tenant_id=e.tenant_id, request_id=e.request_id, pool=e.pool)
        self._batcher.spawn(self._settle_unused(req))

    async def _settle_unused(self, req: pb.CompleteRequest) -> None:
        try:
            await self._spool.put(req)
        except ControlPlaneUnavailable as exc:
            log.warning("the late admission of %r is held until its TTL: %s", req.request_id, exc)

    # ------------------------------------------------------------- Complete

    async def complete(
        self, tenant_id: str, request_id: str, *, prompt_tokens: int, generated_tokens: int,
        cached_prompt_tokens: int = 0, exec_start_unix_ns: int = 0, exec_end_unix_ns: int = 0,
        kv_cache_miss_rate: float | None = None, first_token_unix_ns: int = 0,
        correlation_id: str = "",
    ) -> Completion:  # fmt: skip
        """Settle with the real usage. ``kv_cache_miss_rate``: this request's
        own rate, when the engine measured it (None: the pool's window rate).
        ``first_token_unix_ns``: when its first token came (0 = unknown): the
        pool gate learns from it how soon a release gets its first token.
        ``correlation_id``: the caller's own id for the request (0..128
        printable characters), recorded in the ledger beside request_id."""
        if self._closed:
            raise RuntimeError("the client is closed")
        check_complete_args(tenant_id, request_id, prompt_tokens, generated_tokens,
                            cached_prompt_tokens, exec_start_unix_ns, exec_end_unix_ns,
                            kv_cache_miss_rate, first_token_unix_ns, correlation_id)  # fmt: skip
        req = pb.CompleteRequest(
            tenant_id=tenant_id, request_id=request_id, prompt_tokens=prompt_tokens,
            generated_tokens=generated_tokens, cached_prompt_tokens=cached_prompt_tokens,
            exec_start_unix_ns=exec_start_unix_ns, exec_end_unix_ns=exec_end_unix_ns,
            first_token_unix_ns=first_token_unix_ns, correlation_id=correlation_id,
        )  # fmt: skip
        if kv_cache_miss_rate is not None:
            req.kv_cache_miss_rate = kv_cache_miss_rate
            req.kv_cache_miss_rate_reported = True
        self.counters.completes += 1
        key = (tenant_id, request_id)
        self._admitted.completing.add(key)  # not re-announced while its Complete travels
        try:
            done = await self._complete_request(req, self._admitted.get(key))
        finally:
            self._admitted.completing.discard(key)
        self._admitted.pop(key)  # kept when the Complete raised: the caller may retry
        return done

    async def _complete_request(self, req: pb.CompleteRequest, adm: Admitted | None) -> Completion:
        if adm is not None and adm.offline:
            _attach_offline(req, adm)
        if adm is not None and adm.pool:  # the owner of its pool settles it (docs/ha.md)
            req.pool = adm.pool
        prefer = adm.address if adm is not None else ""
        restoring = adm is not None and bool(adm.admission_token)
        while self._replicas.any_up.up:
            via: list[str] = []  # the replicas it was sent to, in order
            try:
                return completion_of_response(await self._send_complete(req, prefer, via))
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise ValueError(exc.details()) from None
                if (
                    code == grpc.StatusCode.NOT_FOUND
                    and adm is not None
                    and not req.HasField("offline")
                ):
                    # A new owner that has not been handed the reservation yet
                    # (its Complete overtook the re-announce): hand it over,
                    # once, and send the Complete again there: refunded at
                    # the multiplier locked at admission.
                    if restoring and via:
                        restoring = False
                        key = (req.tenant_id, req.request_id)
                        if await self._reannouncer.restore(key, adm, via[-1]):
                            prefer = via[-1]
                            continue
                    _attach_offline(req, adm)  # the server forgot it: book what ran
                    continue
                if not (code in TRANSPORT_CODES or offline_refused(exc, req)):
                    raise
                break  # (the replica's breaker heard of it in the routing)
        # Unreachable: buffer it, with what the server needs to book it if
        # it no longer holds the reservation when it gets it.
        if adm is not None:
            _attach_offline(req, adm)
        if not req.exec_end_unix_ns:
            req.exec_end_unix_ns = max(time.time_ns(), req.exec_start_unix_ns)
        added = await self._spool.put(req)
        if added:
            self.counters.completes_buffered += 1
        return buffered_completion(req.request_id, duplicate=not added)

    async def _send_complete(
        self, req: pb.CompleteRequest, prefer: str = "", via: list[str] | None = None
    ) -> pb.CompleteResponse:
        """``via`` (when given) gets the address of each replica tried."""

        async def send(r: Replica) -> pb.CompleteResponse:
            if via is not None:
                via.append(r.address)
            resp: pb.CompleteResponse = await r.stub.Complete(
                req, timeout=self.complete_deadline_s, metadata=self._meta
            )
            return resp

        key = req.pool or (req.offline.pool if req.HasField("offline") else "")
        return await self._replicas.call(key, key, send, prefer)

    def _moved(self, key: str, address: str) -> None:
        """A NOT_OWNER (a Complete's, a load report's) named ``key``'s new
        owner: hand it the key's open admissions, in the background."""
        if self._reannouncer.needed(key, address):
            self._batcher.spawn(self._reannouncer.before(key, address, 0.0))

    async def _send_reannounce(
        self, address: str, req: pb.ReannounceRequest
    ) -> pb.ReannounceResponse | None:
        """None (nothing sent) while ``address`` is known down."""
        r = self._replicas.get(address)
        if not r.breaker.up:
            return None
        try:
            res: pb.ReannounceResponse = await r.stub.Reannounce(
                req, timeout=self.complete_deadline_s, metadata=self._meta
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() in TRANSPORT_CODES:
                r.breaker.failed(exc, "Reannounce")
            raise
        return res

    @property
    def open_admissions(self) -> int:
        """Requests admitted and not completed that the client remembers."""
        return len(self._admitted)

    @property
    def pending_completions(self) -> int:
        return self._spool.pending

    async def flush(self, timeout_s: float | None = None) -> int:
        """Deliver the buffered Completes now; wait until done or
        ``timeout_s`` (None: until done, which is never while the control
        plane stays down). Returns how many were handled meanwhile."""
        return await self._spool.flush(timeout_s)

    # ------------------------------------------------- ReportLoad, GetLimits

    async def report_load(self, report: pb.LoadReport) -> pb.LoadReportAck | None:
        """None when the control plane is unreachable (the next report
        replaces this one: nothing is buffered)."""
        if not self._replicas.any_up.up:
            self.counters.report_load_failures += 1
            await asyncio.sleep(0)  # fail fast, but yield (see Batcher.admit)
            return None

        async def send(r: Replica) -> pb.LoadReportAck:
            ack: pb.LoadReportAck = await r.stub.ReportLoad(
                report, timeout=self.deadline_s, metadata=self._meta
            )
            return ack

        try:
            return await self._replicas.call(report.pool, report.pool, send)
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(exc.details()) from None
            if code not in TRANSPORT_CODES:
                raise
            self.counters.report_load_failures += 1
            return None

    async def limits(self, tenant_id: str) -> Limits | None:
        return await self._limits.get(tenant_id, self.deadline_s)


def _attach_offline(req: pb.CompleteRequest, adm: Admitted) -> None:
    req.offline.CopyFrom(pb.OfflineAdmission(lane=adm.lane, model=adm.model, pool=adm.pool))
    if not req.exec_start_unix_ns:
        # When it ran (from its admission here), not when the server books
        # it: possibly much later, and after the end the SDK recorded.
        req.exec_start_unix_ns = min(adm.at_ns, req.exec_end_unix_ns or adm.at_ns)

"""Owner gating of ``ShouldRateLimit`` across replicas (docs/envoy.md,
"Several replicas"; docs/ha.md, "Serving as N replicas").

Envoy calls whichever replica its cluster points at and cannot follow a
``NOT_OWNER`` redirect, so a replica that does not own the cell of the
call's pool **forwards** the call to the owner (its advertised address, the
same port and service), with the caller's ``authorization`` metadata and a
hop marker (``x-burstgate-forwarded``), and returns the owner's answer
unchanged. One replica decides a cell, whichever replica Envoy calls.

Rules:

- **one hop**: a call that carries the marker is never forwarded again; if
  it lands on a replica that does not own the cell either (the owner
  changed in between), it is answered OVER_LIMIT, ``retry-after`` 1 s,
  ``x-burstgate-reason: not_owner``. Deciding it there would make two
  deciders for the cell; a second hop could chase a moving owner.
- **owner unknown, unreachable, or the cell being claimed**: the route is
  asked again every ``RETRY_S`` for at most the claim wait
  (``Ownership.claim_wait_s``, min(1 s, TTL/3)) and Envoy's deadline minus
  a margin; a replica that meanwhile became the owner (a takeover, a claim)
  decides itself, a new owner's address is tried; then OVER_LIMIT with
  ``retry-after`` (never a gRPC error, which Envoy's ``failure_mode_deny``
  would turn into a 500 or, worse, into "no limit").
- **the deadline is passed on**: the forward's timeout is Envoy's time left
  minus the margin the held calls use (a tenth of it, at most 50 ms), so the
  owner's own held-call logic answers inside it and this replica answers
  Envoy before Envoy gives up.
- **the owner's errors** (``UNAUTHENTICATED`` for a key it refuses,
  ``PERMISSION_DENIED``, an overloaded ledger, ...) are passed on as they
  are: the same code, message and details. A transport failure
  (``UNAVAILABLE`` without status details: nothing listening, a replica
  stopping) counts as unreachable.
- the stream-done (response-path) call goes to the owner of the pool its
  request path used: the reservation's pool when this replica holds the
  reservation, else the pool the request path would use with the
  configured estimate (docs/envoy.md says when to name the pool).

One channel per owner address, kept and reused, closed at stop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from controlplane._proto.envoy.service.ratelimit.v3 import rls_pb2 as rls
from controlplane._proto.envoy.service.ratelimit.v3 import rls_pb2_grpc as rls_grpc
from controlplane.domain.errors import InvalidArgument
from controlplane.domain.units import NS_PER_S
from controlplane.domain.validate import check_pool
from controlplane.ha.serving import Ownership, Redirect
from controlplane.integrations.envoy import answers as A
from controlplane.integrations.envoy.config import EnvoyConfig
from controlplane.integrations.envoy.mapping import Ask, Phase
from controlplane.rpc.auth import admission_scope
from controlplane.service import AdmissionService, Route
from fastpath import Reason

HOP_HEADER = "x-burstgate-forwarded"  # value: the forwarding replica's member id
PASSED_HEADERS = frozenset({"authorization"})
# Between two looks at the owner while it is unknown or unreachable (the
# snapshot is re-read at most every MISS_REFRESH_S, 50 ms, anyway).
RETRY_S = 0.05
# What a call the owner could not be found for is told (retry-after rounds
# up to whole seconds: 1 is the shortest it can say).
GIVE_UP_RETRY_NS = NS_PER_S
# As the held calls (servicer.py): answer a tenth of the time left, at most
# 50 ms, before the caller's deadline.
MARGIN_S, MARGIN_SHARE = 0.05, 0.1
# A forward with less time than this left is not sent (it could not return).
MIN_FORWARD_S = 0.005
# The forward's timeout when the caller set no deadline (Envoy always does),
# on top of the mapping's max_wait_ms.
NO_DEADLINE_S = 2.0
# Channels kept (one per owner address); beyond, the oldest is closed.
MAX_CHANNELS = 64
# A failed connection is retried soon: a restarted owner is reachable again
# at once, not after grpc's default 1 s (growing to 120 s) backoff.
CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
]

# burstgate_envoy_forwarded_total{outcome}
FORWARDED = "forwarded"  # the owner answered; its answer returned
OWNER_ERROR = "owner_error"  # the owner answered a gRPC error; passed on
UNREACHABLE = "unreachable"  # the owner did not answer within the bound
NO_OWNER = "no_owner"  # no owner known within the bound
TIMEOUT = "timeout"  # the caller's deadline left no time for a forward
HOP_LIMIT = "hop_limit"  # a forwarded call for a cell not owned here
OUTCOMES = (FORWARDED, OWNER_ERROR, UNREACHABLE, NO_OWNER, TIMEOUT, HOP_LIMIT)

_TRANSPORT = frozenset({grpc.StatusCode.UNAVAILABLE})
_DETAILS_KEY = "grpc-status-details-bin"
_NOT_OWNER = Reason.NOT_OWNER.name.lower()  # x-burstgate-reason of the hop limit's refusal

Log = Callable[..., None]


@dataclass(frozen=True, slots=True)
class GaveUp:
    outcome: str
    owner: str  # the address last tried ("" when none was known)


def margin(remaining: float) -> float:
    return min(MARGIN_S, remaining * MARGIN_SHARE)


class OwnerGate:
    """Forwards the calls whose cell another replica owns. ``active`` is
    False on a single replica (SQLite: no coordinator), and then the
    servicer never calls :meth:`answer`."""

    def __init__(
        self,
        ownership: Ownership,
        service: AdmissionService,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        log: Log | None = None,
    ) -> None:
        self.ownership = ownership
        self._svc = service
        self._credentials = credentials
        self.log = log  # (kind, event, **fields): the servicer's throttled log
        self._channels: dict[str, tuple[grpc.aio.Channel, rls_grpc.RateLimitServiceStub]] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self.counts: dict[str, int] = dict.fromkeys(OUTCOMES, 0)
        self.stale_routes = 0  # forwards that reached a member no longer the owner
        self._closed = False

    @property
    def active(self) -> bool:
        return not self.ownership.local

    # ----------------------------------------------------------- the route

    def pool_of(self, ask: Ask, cfg: EnvoyConfig, route: Route | None = None) -> str:
        """The pool the decision uses (docs/ha.md: ``ReplicaDoors.pool_of``);
        ``route``: the request path's, when the caller has it (``route_of``)."""
        if ask.phase == Phase.RESPONSE:
            rec = self._svc.views.record(ask.tenant, ask.request_id) if ask.request_id else None
            if rec is not None and rec.pool:
                return rec.pool
            tokens = cfg.defaults.estimate_tokens
        else:
            if route is not None:
                return ask.pool or route.pool
            tokens = ask.tokens
        return self._svc.replicas.pool_of(ask.tenant, ask.lane, 0, tokens, ask.pool)

    def route_of(self, ask: Ask) -> Route | None:
        """Where a request-path call goes (``ReplicaDoors.route``), computed
        once for the owner check and the decision; None on the response
        path or for a bad field (the decision names it)."""
        if ask.phase == Phase.RESPONSE:
            return None
        return self._svc.replicas.route(ask.tenant, ask.lane, 0, ask.tokens, ask.pool)

    async def _route(self, pool: str) -> Redirect | None:
        try:
            return await self.ownership.route(pool)
        except ValueError as exc:  # a pool named like an explicit cell it is not in
            raise InvalidArgument("pool", str(exc)) from None

    async def answer(
        self,
        request: rls.RateLimitRequest,
        ask: Ask,
        cfg: EnvoyConfig,
        context: grpc.aio.ServicerContext,
        route: Route | None = None,
    ) -> rls.RateLimitResponse | None:
        """None when this replica decides the call; else the answer (the
        owner's, or OVER_LIMIT when the owner could not be reached in time).
        Ends the call with the owner's status when the owner answered an
        error. InvalidArgument for a pool that cannot be a cell. ``route``:
        as :meth:`pool_of`'s."""
        pool = self.pool_of(ask, cfg, route)
        if pool:
            check_pool(pool)  # a bad name never reaches the lease table
            # nor an undeclared one, nor one a scoped key may not use
            # (answered OVER_LIMIT with x-burstgate-error by the servicer)
            if pool not in self._svc.views.declared_pools():
                views = self._svc.views
                if ask.phase == Phase.RESPONSE and views.record(ask.tenant, ask.request_id):
                    return None  # admitted here before the pool was undeclared: settle here
                self._svc.replicas.check_pool(pool)
            scope = admission_scope.get()
            if scope is not None:
                scope.check_tenant("tenant_id", ask.tenant)
                scope.check_pool("pool", pool)
        # The last snapshot's lease holder first (no table read per call); a
        # stale one answers "not the owner" and the route is asked then.
        where = self.ownership.leased_owner(pool) or await self._route(pool)
        if where is None:
            return None
        metadata = context.invocation_metadata() or ()
        if any(k == HOP_HEADER for k, _ in metadata):
            return self._gave_up(ask, GaveUp(HOP_LIMIT, where.address), pool)
        remaining = context.time_remaining()
        budget = None if remaining is None else remaining - margin(remaining)
        return await self._forward(request, ask, cfg, context, pool, where, budget, metadata)

    async def _forward(
        self,
        request: rls.RateLimitRequest,
        ask: Ask,
        cfg: EnvoyConfig,
        context: grpc.aio.ServicerContext,
        pool: str,
        where: Redirect | None,
        budget: float | None,
        metadata: Any,
    ) -> rls.RateLimitResponse | None:
        clock = time.monotonic
        start = clock()
        end = None if budget is None else start + budget
        # Looking for the owner: at most the claim wait (and the deadline).
        wait = self.ownership.claim_wait_s
        look_until = start + (wait if budget is None else min(wait, budget))
        passed = [(k, v) for k, v in metadata if k in PASSED_HEADERS]
        coord = self.ownership.coordinator
        me = coord.member_id if coord is not None else ""
        own_address = coord.address if coord is not None else ""
        passed.append((HOP_HEADER, me))
        outcome, tried = NO_OWNER, ""
        while True:
            if where is None:
                return None  # ours now (claimed, or taken over): decide here
            if where.address and where.address != own_address:
                tried = where.address
                no_deadline = NO_DEADLINE_S + cfg.max_wait_ms / 1000
                timeout = no_deadline if end is None else end - clock()
                if timeout < MIN_FORWARD_S:
                    return self._gave_up(ask, GaveUp(TIMEOUT, tried), pool)
                try:
                    out: rls.RateLimitResponse = await self._stub(tried).ShouldRateLimit(
                        request, metadata=passed, timeout=timeout
                    )
                except grpc.aio.AioRpcError as exc:
                    if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                        return self._gave_up(ask, GaveUp(TIMEOUT, tried), pool)
                    if not _transport_failure(exc):
                        self.counts[OWNER_ERROR] += 1
                        await context.abort(exc.code(), exc.details() or "", _details(exc))
                        raise AssertionError("unreachable: context.abort raises") from None
                    outcome = UNREACHABLE
                else:
                    if not _not_owner(out):
                        self.counts[FORWARDED] += 1
                        return out
                    self.stale_routes += 1
                    outcome = NO_OWNER  # it was not the owner (any more): look again
            if clock() + RETRY_S > look_until:
                return self._gave_up(ask, GaveUp(outcome, tried), pool)
            await asyncio.sleep(RETRY_S)
            where = await self._route(pool)

    def _gave_up(self, ask: Ask, why: GaveUp, pool: str) -> rls.RateLimitResponse:
        self.counts[why.outcome] += 1
        if self.log is not None:
            self.log(
                f"forward:{why.outcome}", "envoy call not decided here: the pool's "
                "owner is another replica", outcome=why.outcome, pool=pool[:64],
                owner=why.owner, phase=ask.phase.value,
            )  # fmt: skip
        verdict = A.Verdict(
            over=True, reason=int(Reason.NOT_OWNER), retry_after_ns=GIVE_UP_RETRY_NS
        )
        return A.response(verdict, ask.mapped, True)

    # ------------------------------------------------------------ channels

    def _stub(self, address: str) -> rls_grpc.RateLimitServiceStub:
        found = self._channels.get(address)
        if found is not None:
            return found[1]
        if self._closed:
            raise RuntimeError("the Envoy forwarder is closed")
        if len(self._channels) >= MAX_CHANNELS:
            oldest = next(iter(self._channels))
            old, _ = self._channels.pop(oldest)
            task = asyncio.ensure_future(old.close(grace=1.0))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        if self._credentials is None:
            channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        else:
            channel = grpc.aio.secure_channel(address, self._credentials, options=CHANNEL_OPTIONS)
        stub = rls_grpc.RateLimitServiceStub(channel)
        self._channels[address] = (channel, stub)
        return stub

    @property
    def channels(self) -> list[str]:
        return list(self._channels)

    async def close(self) -> None:
        """At stop: every channel closed (calls still on them are cancelled)."""
        self._closed = True
        channels, self._channels = self._channels, {}
        for channel, _ in channels.values():
            await channel.close(grace=None)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    def collector(self) -> Collector:
        return _GateCollector(self)


def _not_owner(out: rls.RateLimitResponse) -> bool:
    """The member reached is not the owner (it answered a forwarded call
    with the hop limit's refusal): the route was stale."""
    if out.overall_code != rls.RateLimitResponse.OVER_LIMIT:
        return False
    return any(h.key == A.REASON and h.value == _NOT_OWNER for h in out.response_headers_to_add)


def _transport_failure(exc: grpc.aio.AioRpcError) -> bool:
    """UNAVAILABLE from the transport (nothing listening, a replica
    stopping), not one the owner's servicer answered: those carry status
    details (controlplane/rpc/errors.py, e.g. LEDGER_UNAVAILABLE)."""
    if exc.code() not in _TRANSPORT:
        return False
    return not any(k == _DETAILS_KEY for k, _ in exc.trailing_metadata() or ())


def _details(exc: grpc.aio.AioRpcError) -> tuple[tuple[str, str | bytes], ...]:
    """The owner's rich status details (ErrorInfo, RetryInfo), passed on."""
    return tuple((k, v) for k, v in exc.trailing_metadata() or () if k == _DETAILS_KEY)


def peer_credentials(
    cert: bytes | None, key: bytes | None, ca: bytes | None
) -> grpc.ChannelCredentials | None:
    """The forward's TLS when the server serves TLS: the owner's certificate
    checked against ``ca`` (the server's client CA: one CA for the fleet),
    else the system roots; this replica's own certificate presented, for an
    owner that requires client certificates."""
    if cert is None or key is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                        certificate_chain=cert)  # fmt: skip


class _GateCollector(Collector):
    def __init__(self, gate: OwnerGate) -> None:
        self._gate = gate

    def collect(self) -> Iterator[Metric]:
        c = CounterMetricFamily(
            "burstgate_envoy_forwarded",
            "Envoy rate-limit calls for a pool owned by another replica, by outcome "
            "(forwarded: the owner's answer returned; owner_error: its error passed on; "
            "unreachable, no_owner, timeout: answered OVER_LIMIT here; hop_limit: a "
            "forwarded call for a cell not owned here, answered OVER_LIMIT)",
            labels=["outcome"],
        )
        for outcome in OUTCOMES:
            c.add_metric([outcome], self._gate.counts[outcome])
        yield c
        yield CounterMetricFamily(
            "burstgate_envoy_forward_stale_routes",
            "Forwards that reached a replica no longer the owner (the lease snapshot "
            "was stale); the owner was looked up again within the same call",
            value=self._gate.stale_routes,
        )

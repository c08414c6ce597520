"""``envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`` on
burstgate's gRPC port (docs/envoy.md).

One call, one decision:

- request path, a cost > 0: Admit (reserve the cost; with a request id the
  response-path call settles it, without one it is settled at once, at the
  cost, as envoyproxy/ratelimit counts hits);
- request path, ``hits_addend`` 0: a check that spends nothing;
- response path (``phase: response``): settle (settle.py); always answered
  OK, Envoy ignores the answer of a stream-done call.

A request burstgate cannot decide (wrong domain, no tenant, an unknown
lane, a value that is not an id) is answered OVER_LIMIT with
``x-burstgate-error`` naming the entry, and logged (at most once per
``LOG_EVERY_S`` per kind): never passed as OK, so that a client cannot
escape its limits by sending a bad header, and never a crash. The auth
interceptor treats this service as the admission API (a sidecar key,
``authorization: Bearer ...``, which Envoy sends as ``initial_metadata``).
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING

import grpc
import structlog

from controlplane._proto.envoy.service.ratelimit.v3 import rls_pb2 as rls
from controlplane._proto.envoy.service.ratelimit.v3 import rls_pb2_grpc as rls_grpc
from controlplane.domain import AdmitDecision, Decision
from controlplane.domain.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
)
from controlplane.integrations.envoy import answers as A
from controlplane.integrations.envoy.config import LiveConfig
from controlplane.integrations.envoy.forward import OwnerGate
from controlplane.integrations.envoy.mapping import Ask, BadInput, Phase, parse
from controlplane.integrations.envoy.settle import settle
from controlplane.rpc.auth import admission_scope
from controlplane.rpc.errors import unary_errors
from controlplane.rpc.owners import ensure_shares
from controlplane.service import AdmissionService, Route
from controlplane.service.limits import TenantLimits
from controlplane.service.waiting import WaitingRoom
from fastpath import Reason

if TYPE_CHECKING:
    from controlplane.ledger.metering import Metering

log = structlog.get_logger("burstgate.envoy")

SERVICE_NAME = rls.DESCRIPTOR.services_by_name["RateLimitService"].full_name
# Bad input is logged at most this often per kind (field), and counted always.
LOG_EVERY_S = 10.0
# A call held in the queue is answered this much before Envoy's own timeout
# (a tenth of the time left, at most 50 ms): Envoy then gets OVER_LIMIT with
# retry-after, not a timeout that its failure_mode_deny would decide.
ANSWER_MARGIN_S, ANSWER_MARGIN_SHARE = 0.05, 0.1
# Errors of the caller's input: answered OVER_LIMIT with x-burstgate-error.
_INPUT_ERRORS = (InvalidArgument, NotFound, PermissionDenied, FailedPrecondition, AlreadyExists)


class RateLimitServicer(rls_grpc.RateLimitServiceServicer):
    service_name = SERVICE_NAME

    def __init__(
        self,
        service: AdmissionService,
        config: LiveConfig,
        waiting: WaitingRoom | None = None,
        *,
        metering: Metering | None = None,
        gate: OwnerGate | None = None,
    ) -> None:
        """``gate``: owner gating across replicas (forward.py); None, or an
        inactive gate (one replica), decides every call here."""
        self._svc = service
        self.config = config
        self._waiting = waiting or WaitingRoom(service)
        self.metering = metering
        self.gate = gate
        self._logged: dict[str, float] = {}
        if gate is not None and gate.log is None:
            gate.log = self._log_once
        # Counters (tests, and /metrics through ServerCollector if wanted).
        self.calls = {"admit": 0, "check": 0, "settle": 0, "refused": 0, "bad_input": 0}

    @unary_errors
    async def ShouldRateLimit(
        self, request: rls.RateLimitRequest, context: grpc.aio.ServicerContext
    ) -> rls.RateLimitResponse:
        cfg = self.config.current
        try:
            ask = parse(request, cfg)
        except BadInput as exc:
            return self._bad(str(exc), exc.field, len(request.descriptors))
        gate = self.gate
        route = None  # computed once: the owner check's is the decision's
        try:
            if gate is not None and gate.active:
                # Another replica owns the pool's cell: its answer (forward.py).
                route = gate.route_of(ask)
                forwarded = await gate.answer(request, ask, cfg, context, route)
                if forwarded is not None:
                    return forwarded
                if ask.phase != Phase.RESPONSE:  # decided here: under this replica's share
                    left = context.time_remaining()
                    await ensure_shares(gate.ownership, self._svc, (ask.tenant,),
                                        None if left is None else left / 4)  # fmt: skip
            if ask.phase == Phase.RESPONSE:
                return await self._settle(ask)
            if ask.cost_given and ask.tokens == 0:
                verdict = self._check(ask)
            else:
                verdict = await self._admit(ask, context, route)
        except _INPUT_ERRORS as exc:
            field = getattr(exc, "field", "") or type(exc).__name__
            return self._bad(str(exc), field, len(ask.mapped), ask.mapped)
        if verdict.over:
            self.calls["refused"] += 1
            if verdict.reason in (Reason.UNKNOWN_TENANT, Reason.TENANT_DISABLED):
                self._log_once(
                    f"reason:{verdict.reason}", "envoy request refused: tenant",
                    reason=Reason(verdict.reason).name, tenant=ask.tenant[:64],
                )  # fmt: skip
        return A.response(verdict, ask.mapped, cfg.response_headers)

    # ------------------------------------------------------------- request

    def _check(self, ask: Ask) -> A.Verdict:
        self.calls["check"] += 1
        scope = admission_scope.get()
        if scope is not None:
            scope.check_tenant("tenant_id", ask.tenant)
        reason, retry_ns, limits = self._svc.views.check_only(ask.tenant)
        return A.Verdict(
            over=reason != 0, reason=reason, retry_after_ns=retry_ns,
            window=A.binding(limits, reason, retry_ns),
        )  # fmt: skip

    async def _admit(
        self, ask: Ask, context: grpc.aio.ServicerContext, route: Route | None = None
    ) -> A.Verdict:
        self.calls["admit"] += 1
        scope = admission_scope.get()
        if scope is not None:
            scope.check_tenant("tenant_id", ask.tenant)
        rid = ask.request_id or uuid.uuid4().hex
        known = self._svc.views.record(ask.tenant, rid) if ask.request_id else None
        if known is not None and known.is_settled:
            # Envoy makes one request-path call per request: a settled id
            # again is a new request under an old id (a replay would admit it
            # free of charge), not a repeated call.
            raise InvalidArgument(
                "request_id", f"{rid[:64]!r} belongs to a request already settled"
            )
        max_wait_ms = self.config.current.max_wait_ms
        if max_wait_ms and ask.request_id:
            remaining, bound = context.time_remaining(), max_wait_ms / 1000
            if remaining is not None:
                remaining -= min(ANSWER_MARGIN_S, remaining * ANSWER_MARGIN_SHARE)
            timeout = bound if remaining is None else max(0.0, min(remaining, bound))
            d = await self._waiting.admit(
                ask.tenant, rid, ask.lane, 0, ask.tokens, ask.model, ask.pool,
                timeout_s=timeout, scope=scope, retry_key=ask.retry_key, attempt=ask.attempt,
                route=route,
            )  # fmt: skip
        else:
            out = self._svc.admit_or_wait(
                ask.tenant, rid, ask.lane, 0, ask.tokens, ask.model, ask.pool,
                wait=False, scope=scope, retry_key=ask.retry_key, attempt=ask.attempt,
                route=route,
            )  # fmt: skip
            if not isinstance(out, AdmitDecision):  # wait=False never queues
                raise TypeError("admit_or_wait(wait=False) queued a request")
            d = out
            self._waiting.reschedule()
        admitted = d.decision == Decision.ADMIT
        if admitted and not ask.request_id and not d.duplicate:
            # Nothing will settle it: charge the cost now, as a hit.
            await settle(self._svc, self._waiting, self.metering,
                         _with_id(ask, rid), scope)  # fmt: skip
        reason = 0 if admitted else int(d.reason)
        return A.Verdict(
            over=not admitted, reason=reason, retry_after_ns=0 if admitted else d.retry_after_ns,
            window=A.binding(self._limits(ask.tenant), reason, d.retry_after_ns),
            retryable=d.retryable,
        )  # fmt: skip

    def _limits(self, tenant: str) -> TenantLimits | None:
        try:
            return self._svc.views.tenant_limits(tenant)
        except NotFound:  # unknown (charged to the default tenant, or refused)
            return None

    # ------------------------------------------------------------ response

    async def _settle(self, ask: Ask) -> rls.RateLimitResponse:
        self.calls["settle"] += 1
        scope = admission_scope.get()
        if scope is not None:  # as the request path: a key settles only its own tenants
            scope.check_tenant("tenant_id", ask.tenant)
        s = await settle(self._svc, self._waiting, self.metering, ask, scope)
        if s.outcome == "booked" and ask.request_id:
            # Usage with no reservation under its id: worth knowing (the
            # request-path call did not reserve, or under another id).
            self._log_once("booked", "envoy usage booked without a reservation",
                           tenant=ask.tenant[:64], request_id=ask.request_id[:64])  # fmt: skip
        return A.response(A.Verdict(over=False), ask.mapped, False)

    # ------------------------------------------------------------- errors

    def _bad(
        self, message: str, field: str, n: int, mapped: tuple[bool, ...] | None = None
    ) -> rls.RateLimitResponse:
        self.calls["bad_input"] += 1
        self._log_once(f"bad:{field}", "envoy request not decided", error=message[:300])
        verdict = A.Verdict(over=True, error=message)
        return A.response(verdict, mapped or (True,) * n, True)

    def _log_once(self, kind: str, event: str, **fields: object) -> None:
        now = time.monotonic()
        if now - self._logged.get(kind, -LOG_EVERY_S) >= LOG_EVERY_S:
            if len(self._logged) > 1024:
                self._logged.clear()
            self._logged[kind] = now
            log.warning(event, **fields)

    async def close(self) -> None:
        """At stop: the forward's channels (forward.py)."""
        if self.gate is not None:
            await self.gate.close()


def _with_id(ask: Ask, rid: str) -> Ask:
    from dataclasses import replace

    return replace(ask, request_id=rid, phase=Phase.RESPONSE)

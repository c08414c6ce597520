"""The server interceptor: authentication, authorization, access logs and
RPC metrics for every service on the port, in one layer.

Rules by service:

- health and reflection: public, untouched.
- ``AdmissionService``: a ``sidecar`` key when ``admission_auth`` is on,
  checked against an in-memory copy of the keys (no SQL per Admit). A key
  with a scope (its tenants and pools) gets the handler that sets
  :data:`admission_scope` for the call; the servicer checks the request
  against it. Latency and status counts go into plain ints
  (:class:`~controlplane.telemetry.metrics.RpcStats`); access logs are
  sampled (``admission_log_sample``, default off: a log line costs more
  than the decision).
- ``AdminService`` (and any other service): an ``admin`` or ``viewer`` key,
  checked against the same in-memory copy before anything touches the
  database (a revocation made through this server applies to the next call,
  one made by another process within the config poll interval); a key id the
  copy does not know yet makes it re-read the keys, at most once per
  ``UNKNOWN_KEY_REFRESH_S``; the call waits for that re-read at most
  ``UNKNOWN_KEY_WAIT_S`` from its start, and not at all while the last
  re-read failed (the database is unreachable) or when a re-read since
  which the keys have not changed did not know the id either: then it is
  refused at once. An authentication never waits on the database longer.
  ``viewer`` may call Get*/List*/Export* only. Every call gets an access log
  line and a request id.

Keys and secrets are never logged; neither is any request payload beyond
ids and counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import random
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import structlog

from controlplane.aiotime import within
from controlplane.auth import KeyCache
from controlplane.domain.audit import Actor
from controlplane.domain.errors import DomainError, PermissionDenied, Unauthenticated
from controlplane.domain.keys import Principal, Role, bearer_token, split_key
from controlplane.domain.scope import KeyScope
from controlplane.rpc.dbcall import DbCaller
from controlplane.rpc.errors import abort, error_status
from controlplane.telemetry.grpc_metrics import RpcStats, grpc_type
from controlplane.telemetry.histogram import LatencyHistogram

log = structlog.get_logger("burstgate.access")

ADMIN_SERVICE = "burstgate.v1.AdminService"
ADMISSION_SERVICE = "burstgate.v1.AdmissionService"
# Envoy's rate-limit service (controlplane/integrations/envoy) decides
# requests as Admit does: the same sidecar keys and scopes.
ENVOY_RLS_SERVICE = "envoy.service.ratelimit.v3.RateLimitService"
ADMISSION_SERVICES = frozenset({ADMISSION_SERVICE, ENVOY_RLS_SERVICE})
PUBLIC_SERVICES = frozenset(
    {
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
        "grpc.reflection.v1.ServerReflection",
    }
)
# Methods a viewer may call (on AdminService and any other operator service,
# e.g. the ledger's ExportLedger); ListApiKeys stays admin-only.
READ_PREFIXES = ("Get", "List", "Export")
ADMIN_ONLY_READS = frozenset({"ListApiKeys"})
# Admission methods operators may call too (owner discovery, docs/ha.md).
OPERATOR_ADMISSION_READS = frozenset({"GetCellOwners"})
# Admission methods whose server-side latency is the "decision latency".
DECISION_METHODS = frozenset({"Admit", "AdmitStream", "ShouldRateLimit"})
MAX_REQUEST_ID = 128
# Most one forced key refresh per this many seconds for unknown key ids: a
# caller guessing keys costs the database nothing more than the poll does.
UNKNOWN_KEY_REFRESH_S = 1.0
# The most an unknown key id's call waits for that re-read, from its start:
# UNKNOWN_KEY_WAIT_S, or longer on a database whose re-reads are slow (a
# loaded SQLite file): UNKNOWN_KEY_WAIT_TYPICAL x the re-reads' typical
# time, at most UNKNOWN_KEY_WAIT_MAX_S. A database that hangs has no slow
# re-reads to show beforehand, so it holds a call up at most the floor
# (issue 30: refused after 5 s before).
UNKNOWN_KEY_WAIT_S = 0.5
UNKNOWN_KEY_WAIT_TYPICAL = 4.0
UNKNOWN_KEY_WAIT_MAX_S = 3.0
# Wrapped admission handlers kept (one per method and key scope).
MAX_WRAPPED = 4096

_PUBLIC, _ADMISSION, _OPERATOR = 0, 1, 2

# The caller of the admin RPC being handled (set by the interceptor).
current_principal: contextvars.ContextVar[Principal | None] = contextvars.ContextVar(
    "burstgate_principal", default=None
)
current_request_id: contextvars.ContextVar[str] = contextvars.ContextVar(
    "burstgate_request_id", default=""
)
# The scope of the sidecar key of the admission call being handled; None =
# not limited (admission auth off, or a key for every tenant and pool). Set
# by the handler the interceptor wraps around the servicer's method, in the
# call's own context.
admission_scope: contextvars.ContextVar[KeyScope | None] = contextvars.ContextVar(
    "burstgate_admission_scope", default=None
)


@dataclass(frozen=True, slots=True)
class Rule:
    kind: int
    service: str
    method: str
    roles: frozenset[Role]


def rule_for(full_method: str) -> Rule:
    """Who may call ``/package.Service/Method``."""
    service, _, method = full_method.lstrip("/").partition("/")
    if service in PUBLIC_SERVICES:
        return Rule(_PUBLIC, service, method, frozenset())
    if service in ADMISSION_SERVICES:
        roles = {Role.SIDECAR}
        if method in OPERATOR_ADMISSION_READS:
            roles |= {Role.ADMIN, Role.VIEWER}
        return Rule(_ADMISSION, service, method, frozenset(roles))
    read = method.startswith(READ_PREFIXES) and method not in ADMIN_ONLY_READS
    roles = {Role.ADMIN, Role.VIEWER} if read else {Role.ADMIN}
    return Rule(_OPERATOR, service, method, frozenset(roles))


def authorize(principal: Principal, rule: Rule) -> Principal:
    if principal.role not in rule.roles:
        raise PermissionDenied(
            f"role {principal.role.value!r} may not call {rule.service}/{rule.method}"
        )
    return principal


def code_name(context: grpc.aio.ServicerContext) -> str:
    code = context.code()
    if code is None:
        return "OK"
    if isinstance(code, grpc.StatusCode):
        return str(code.name)
    for sc in grpc.StatusCode:  # some grpc versions hand back the int
        if sc.value[0] == code:
            return str(sc.name)
    return str(code)


def failed_code(context: grpc.aio.ServicerContext, exc: BaseException) -> str:
    """The status of a call whose handler raised: the one it set (abort),
    else CANCELLED when the call was cancelled (the client went away) and
    UNKNOWN otherwise (what grpc answers an unhandled exception with)."""
    code = code_name(context)
    if code != "OK":
        return code
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        return "CANCELLED"
    return "UNKNOWN"


def _kind(handler: grpc.RpcMethodHandler) -> str:
    return grpc_type(bool(handler.request_streaming), bool(handler.response_streaming))


def _request_id(metadata: Any) -> str:
    for item in metadata or ():
        if item[0] == "x-request-id":
            value = item[1] if isinstance(item[1], str) else item[1].decode("latin-1")
            if 0 < len(value) <= MAX_REQUEST_ID and value.isprintable():
                return value
            break
    return uuid.uuid4().hex[:16]


def _tenant_of(request: Any) -> str:
    tenant = getattr(request, "tenant_id", None)
    if isinstance(tenant, str):
        return tenant
    nested = getattr(request, "tenant", None)
    value = getattr(nested, "tenant_id", "") if nested is not None else ""
    return value if isinstance(value, str) else ""


class ServerInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    def __init__(
        self,
        *,
        key_cache: KeyCache,
        db: DbCaller,
        stats: RpcStats,
        admission_auth: bool,
        admission_log_sample: float = 0.0,
    ) -> None:
        self.key_cache = key_cache
        self.db = db
        self._refreshed_at = -UNKNOWN_KEY_REFRESH_S
        self._refreshing: asyncio.Future[None] | None = None
        self.stats = stats
        self.admission_auth = admission_auth
        self.admission_log_sample = admission_log_sample
        self._rules: dict[str, Rule] = {}
        # (method, id(scope)) -> (handler as registered, scope, our wrapper around it)
        self._wrapped: dict[
            tuple[str, int],
            tuple[grpc.RpcMethodHandler, KeyScope | None, grpc.RpcMethodHandler],
        ] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method: str = handler_call_details.method
        rule = self._rules.get(method)
        if rule is None:
            rule = self._rules[method] = rule_for(method)
        handler = await continuation(handler_call_details)
        if handler is None or rule.kind == _PUBLIC:
            return handler
        metadata = handler_call_details.invocation_metadata
        if rule.kind == _ADMISSION:
            scope = None
            if self.admission_auth:
                try:
                    principal = self.key_cache.authenticate(bearer_token(metadata))
                    scope = authorize(principal, rule).scope
                except DomainError as exc:
                    return self._refuse(handler, rule, exc)
            return self._admission_handler(method, handler, rule, scope)
        try:
            token = bearer_token(metadata)
            found = self.key_cache.lookup(token)
            operator = found if found is not None else await self._lookup_unknown(token)
            authorize(operator, rule)
        except DomainError as exc:
            return self._refuse(handler, rule, exc)
        return self._operator_handler(handler, rule, operator, _request_id(metadata))

    async def _lookup_unknown(self, token: str) -> Principal:
        """A key id the cache does not know: re-read the keys (one re-read
        shared by concurrent callers, at most one per
        ``UNKNOWN_KEY_REFRESH_S``, none while the last one failed) and look
        again, waiting for it at most ``UNKNOWN_KEY_WAIT_S`` from its start.
        An id a successful re-read did not know either (and the keys have
        not changed since) is refused without one. Unknown: UNAUTHENTICATED,
        and nothing about the database."""
        cache = self.key_cache
        key_id, _ = split_key(token)
        if cache.known_unknown(key_id):
            raise Unauthenticated("invalid or revoked API key")
        now = time.monotonic()
        if (
            self._refreshing is None
            and not cache.unreachable
            and now - self._refreshed_at >= UNKNOWN_KEY_REFRESH_S
        ):
            self._refreshed_at = now
            self._refreshing = asyncio.ensure_future(self._forced_refresh())
            self._refreshing.add_done_callback(_retrieved)
        refreshing = self._refreshing
        cap = min(UNKNOWN_KEY_WAIT_MAX_S,
                  max(UNKNOWN_KEY_WAIT_S, UNKNOWN_KEY_WAIT_TYPICAL * cache.typical_refresh_s))
        wait = self._refreshed_at + cap - now
        if refreshing is not None and not cache.unreachable and wait > 0:
            with contextlib.suppress(Exception):  # a timeout, or logged by the DbCaller
                await within(asyncio.shield(refreshing), wait)
        confirmed = (
            refreshing is not None
            and refreshing.done()
            and not refreshing.cancelled()
            and refreshing.exception() is None
        )
        generation = cache.refreshes
        principal = cache.lookup(token)
        if principal is None:
            if confirmed:
                cache.remember_unknown(key_id, generation)
            raise Unauthenticated("invalid or revoked API key")
        return principal

    async def _forced_refresh(self) -> None:
        """Re-read the keys for an unknown id (bounded like every operator
        database call); whether it reached the database is noted."""
        started = time.monotonic()
        try:
            await self.db.run(self.key_cache.refresh)
        except BaseException:
            self.key_cache.note_refresh(False)
            raise
        else:
            self.key_cache.note_refresh(True, time.monotonic() - started)
        finally:
            self._refreshing = None

    # ------------------------------------------------------------- refusals

    def _refuse(
        self, handler: grpc.RpcMethodHandler, rule: Rule, exc: DomainError
    ) -> grpc.RpcMethodHandler:
        status = error_status(exc)  # ErrorInfo UNAUTHENTICATED / PERMISSION_DENIED
        code = status.code
        message = status.details
        reason = (
            "forbidden"
            if isinstance(exc, PermissionDenied)
            else ("missing" if "missing" in message else "invalid")
        )
        st = self.stats
        st.auth_failures[reason] += 1
        st.method(rule.service, rule.method, _kind(handler))
        st.started[(rule.service, rule.method)] += 1
        st.handled[(rule.service, rule.method, code.name)] += 1
        log.warning(
            "rpc refused", service=rule.service, method=rule.method, code=code.name, reason=reason
        )

        async def deny(_request: Any, context: grpc.aio.ServicerContext) -> None:
            await abort(context, status)

        # No request deserializer: an unauthenticated payload is never parsed.
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(deny)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(deny)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)

    # ------------------------------------------------------------ admission

    def _admission_handler(
        self, method: str, handler: grpc.RpcMethodHandler, rule: Rule, scope: KeyScope | None
    ) -> grpc.RpcMethodHandler:
        # One wrapped handler per method and key scope (a scope is one
        # object per key, replaced when the key cache reloads): the scope
        # reaches the call without an allocation per call.
        cache_key = (method, id(scope))
        cached = self._wrapped.get(cache_key)
        if cached is not None and cached[0] is handler and cached[1] is scope:
            return cached[2]
        hist = self.stats.histogram(rule.method) if rule.method in DECISION_METHODS else None
        handling = self.stats.method(rule.service, rule.method, _kind(handler))
        if not handler.request_streaming and not handler.response_streaming:
            wrapped = grpc.unary_unary_rpc_method_handler(
                self._timed_unary(handler.unary_unary, rule, hist, handling, scope),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        elif (
            handler.request_streaming
            and handler.response_streaming
            and inspect.isasyncgenfunction(handler.stream_stream)
        ):
            wrapped = grpc.stream_stream_rpc_method_handler(
                self._timed_stream(handler.stream_stream, rule, hist, handling, scope),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        elif scope is None:
            wrapped = handler
        else:  # a scope this layer cannot hand to the method: refuse, never ignore it
            exc = PermissionDenied(f"a scoped key may not call {rule.service}/{rule.method}")
            return self._refuse(handler, rule, exc)
        if len(self._wrapped) >= MAX_WRAPPED:
            self._wrapped.clear()  # keys came and went: start over
        self._wrapped[cache_key] = (handler, scope, wrapped)
        return wrapped

    def _timed_unary(
        self,
        behavior: Any,
        rule: Rule,
        hist: LatencyHistogram | None,
        handling: LatencyHistogram,
        scope: KeyScope | None,
    ) -> Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]:
        handled = self.stats.handled
        started = self.stats.started
        key = (rule.service, rule.method)
        ok_key = (rule.service, rule.method, "OK")
        clock = time.perf_counter
        sample = self.admission_log_sample
        rnd = random.random

        async def timed(request: Any, context: grpc.aio.ServicerContext) -> Any:
            t0 = clock()
            started[key] += 1
            admission_scope.set(scope)  # in the call's own context (its own task)
            try:
                response = await behavior(request, context)
            except BaseException as exc:
                code = failed_code(context, exc)
                handled[(rule.service, rule.method, code)] += 1
                handling.observe(clock() - t0)
                if sample and rnd() < sample:
                    self._access(rule, code, clock() - t0, request)
                raise
            dt = clock() - t0
            if hist is not None:
                hist.observe(dt)
            handling.observe(dt)
            handled[ok_key] += 1
            if sample and rnd() < sample:
                self._access(rule, "OK", dt, request)
            return response

        return timed

    def _timed_stream(
        self,
        behavior: Any,
        rule: Rule,
        hist: LatencyHistogram | None,
        handling: LatencyHistogram,
        scope: KeyScope | None,
    ) -> Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]]:
        handled = self.stats.handled
        key = (rule.service, rule.method)
        started, received_n, sent_n = (
            self.stats.started, self.stats.msg_received, self.stats.msg_sent
        )  # fmt: skip
        clock = time.perf_counter
        sample = self.admission_log_sample
        check = self.admission_auth
        key_cache = self.key_cache

        async def timed(
            request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext
        ) -> AsyncIterator[Any]:
            # The servicer answers each batch before it reads the next, so
            # "time since the last batch arrived" is that batch's latency.
            received = [0.0]
            t0 = clock()
            started[key] += 1
            batches = 0
            token = bearer_token(context.invocation_metadata()) if check else ""
            admission_scope.set(scope)

            async def arrivals() -> AsyncIterator[Any]:
                async for item in request_iterator:
                    received[0] = clock()
                    received_n[key] += 1
                    if check:
                        # Checked again per batch against the in-memory key
                        # cache (an HMAC, ~1 us): a key revoked or expired
                        # while the stream is open ends it at its next batch.
                        try:
                            authorize(key_cache.authenticate(token), rule)
                        except DomainError as exc:
                            self.stats.auth_failures["invalid"] += 1
                            log.warning(
                                "stream refused", service=rule.service, method=rule.method,
                                batches=batches, error=str(exc),
                            )  # fmt: skip
                            await abort(context, error_status(exc))
                    yield item

            code = "OK"
            try:
                async for response in behavior(arrivals(), context):
                    if hist is not None:
                        hist.observe(clock() - received[0])
                    batches += 1
                    sent_n[key] += 1
                    yield response
            except BaseException as exc:
                code = failed_code(context, exc)
                raise
            finally:
                handled[(rule.service, rule.method, code)] += 1
                handling.observe(clock() - t0)
                if sample and random.random() < sample:
                    self._access(rule, code, clock() - t0, None, batches=batches)

        return timed

    @staticmethod
    def _access(rule: Rule, code: str, seconds: float, request: Any, **extra: Any) -> None:
        fields: dict[str, Any] = {}
        if request is not None:
            fields["tenant"] = _tenant_of(request)
            rid = getattr(request, "request_id", "")
            if rid:
                fields["request_id"] = rid
        log.info(
            "rpc",
            service=rule.service,
            method=rule.method,
            code=code,
            duration_ms=round(seconds * 1000, 3),
            **fields,
            **extra,
        )

    # ------------------------------------------------------------ operators

    def _operator_handler(
        self, handler: grpc.RpcMethodHandler, rule: Rule, principal: Principal, request_id: str
    ) -> grpc.RpcMethodHandler:
        if handler.request_streaming:
            return handler  # no client-streaming operator RPCs; auth above still applied
        handled = self.stats.handled
        started = self.stats.started
        key = (rule.service, rule.method)
        handling = self.stats.method(rule.service, rule.method, _kind(handler))

        def begin() -> tuple[float, Any, Any]:
            started[key] += 1
            return (
                time.perf_counter(),
                current_principal.set(principal),
                current_request_id.set(request_id),
            )

        def end(t0: float, tokens: tuple[Any, Any], code: str, request: Any) -> None:
            current_principal.reset(tokens[0])
            current_request_id.reset(tokens[1])
            handled[(rule.service, rule.method, code)] += 1
            seconds = time.perf_counter() - t0
            handling.observe(seconds)
            log.info(
                "rpc",
                service=rule.service,
                method=rule.method,
                code=code,
                duration_ms=round(seconds * 1000, 3),
                request_id=request_id,
                key_id=principal.key_id,
                role=principal.role.value,
                tenant=_tenant_of(request),
            )

        if handler.response_streaming:
            if not inspect.isasyncgenfunction(handler.unary_stream):
                return handler  # a writer-style stream: served untimed (none today)
            stream = handler.unary_stream
            sent = self.stats.msg_sent

            async def streamed(request: Any, context: grpc.aio.ServicerContext) -> Any:
                t0, p_token, r_token = begin()
                code = "OK"
                try:
                    await context.send_initial_metadata((("x-request-id", request_id),))
                    with structlog.contextvars.bound_contextvars(request_id=request_id):
                        async for item in stream(request, context):
                            sent[key] += 1
                            yield item
                except BaseException as exc:
                    code = failed_code(context, exc)
                    raise
                finally:
                    end(t0, (p_token, r_token), code, request)

            return grpc.unary_stream_rpc_method_handler(
                streamed,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        behavior = handler.unary_unary

        async def logged(request: Any, context: grpc.aio.ServicerContext) -> Any:
            t0, p_token, r_token = begin()
            code = "OK"
            try:
                await context.send_initial_metadata((("x-request-id", request_id),))
                with structlog.contextvars.bound_contextvars(request_id=request_id):
                    return await behavior(request, context)
            except BaseException as exc:
                code = failed_code(context, exc)
                raise
            finally:
                end(t0, (p_token, r_token), code, request)

        return grpc.unary_unary_rpc_method_handler(
            logged,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


def _retrieved(fut: asyncio.Future[None]) -> None:
    """A forced re-read's failure is logged by the DbCaller: mark it seen."""
    if not fut.cancelled():
        fut.exception()


def current_actor() -> Actor:
    """The caller of the operator RPC being handled, as the audit log names it
    (for other packages' servicers that write audit records)."""
    p = require_principal()
    return Actor(p.actor, p.role.value, current_request_id.get())


def require_principal() -> Principal:
    """The authenticated caller of the admin RPC being handled."""
    principal = current_principal.get()
    if principal is None:  # only if the servicer is mounted without the interceptor
        raise Unauthenticated("no authenticated caller")
    return principal

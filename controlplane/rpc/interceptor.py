"""The server interceptor: one layer for every service on the port, which
looks the method's rule up (rpc/auth.py), checks the caller's key, refuses
(counted and logged) or hands the call to the handler that times, counts
and logs it (rpc/calltiming.py, rpc/accesslog.py).

Admission calls take no SQL: their keys are checked against the key cache's
in-memory copy, and their wrapped handler is built once per method and key
scope. Operator calls may wait a bounded time for a key re-read
(:class:`~controlplane.rpc.auth.UnknownKeys`)."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from controlplane.auth import KeyCache
from controlplane.domain.errors import DomainError, PermissionDenied
from controlplane.domain.keys import bearer_token
from controlplane.domain.scope import KeyScope
from controlplane.rpc import accesslog
from controlplane.rpc.auth import (
    ADMISSION_CALL,
    PUBLIC_CALL,
    Rule,
    UnknownKeys,
    authorize,
    rule_for,
)
from controlplane.rpc.calltiming import (
    DECISION_METHODS,
    kind,
    operator_handler,
    timed_stream,
    timed_unary,
)
from controlplane.rpc.dbcall import DbCaller
from controlplane.rpc.errors import abort, error_status
from controlplane.telemetry.grpc_metrics import RpcStats

# Wrapped admission handlers kept (one per method and key scope).
MAX_WRAPPED = 4096


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
        self.unknown_keys = UnknownKeys(key_cache, db)
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
        if handler is None or rule.kind == PUBLIC_CALL:
            return handler
        metadata = handler_call_details.invocation_metadata
        if rule.kind == ADMISSION_CALL:
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
            operator = found if found is not None else await self.unknown_keys.lookup(token)
            authorize(operator, rule)
        except DomainError as exc:
            return self._refuse(handler, rule, exc)
        rid = accesslog.request_id(metadata)
        return operator_handler(handler, rule, operator, rid, self.stats)

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
        st.method(rule.service, rule.method, kind(handler))
        st.started[(rule.service, rule.method)] += 1
        st.handled[(rule.service, rule.method, code.name)] += 1
        accesslog.refused(rule, code.name, reason)

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
        st = self.stats
        hist = st.histogram(rule.method) if rule.method in DECISION_METHODS else None
        handling = st.method(rule.service, rule.method, kind(handler))
        sample = self.admission_log_sample
        if not handler.request_streaming and not handler.response_streaming:
            wrapped = grpc.unary_unary_rpc_method_handler(
                timed_unary(handler.unary_unary, rule, st, hist, handling, scope, sample),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        elif (
            handler.request_streaming
            and handler.response_streaming
            and inspect.isasyncgenfunction(handler.stream_stream)
        ):
            recheck = self.key_cache if self.admission_auth else None
            wrapped = grpc.stream_stream_rpc_method_handler(
                timed_stream(handler.stream_stream, rule, st, hist, handling, scope, sample,
                             recheck),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )  # fmt: skip
        elif scope is None:
            wrapped = handler
        else:  # a scope this layer cannot hand to the method: refuse, never ignore it
            exc = PermissionDenied(f"a scoped key may not call {rule.service}/{rule.method}")
            return self._refuse(handler, rule, exc)
        if len(self._wrapped) >= MAX_WRAPPED:
            self._wrapped.clear()  # keys came and went: start over
        self._wrapped[cache_key] = (handler, scope, wrapped)
        return wrapped

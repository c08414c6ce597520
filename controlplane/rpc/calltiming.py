"""The handlers the interceptor (rpc/interceptor.py) wraps around a
servicer's method: they time and count the call into plain ints and
histograms (:class:`~controlplane.telemetry.metrics.RpcStats`), put the
caller's identity in the call's own context, and write its access-log line
(rpc/accesslog.py). Each wrapper is built once per method and key scope
for admission calls, so a call allocates nothing for it."""

from __future__ import annotations

import asyncio
import inspect
import random
import time
from bisect import bisect_left
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import structlog

from controlplane.auth import KeyCache
from controlplane.domain.errors import DomainError
from controlplane.domain.keys import Principal, bearer_token
from controlplane.domain.scope import KeyScope
from controlplane.rpc import accesslog
from controlplane.rpc.auth import (
    Rule,
    admission_scope,
    authorize,
    current_principal,
    current_request_id,
)
from controlplane.rpc.errors import abort, error_status
from controlplane.telemetry.grpc_metrics import RpcStats, grpc_type
from controlplane.telemetry.histogram import LatencyHistogram

# Admission methods whose server-side latency is the "decision latency".
DECISION_METHODS = frozenset({"Admit", "AdmitStream", "ShouldRateLimit"})


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


def kind(handler: grpc.RpcMethodHandler) -> str:
    return grpc_type(bool(handler.request_streaming), bool(handler.response_streaming))


# ---------------------------------------------------------------- admission


def timed_unary(
    behavior: Any,
    rule: Rule,
    stats: RpcStats,
    hist: LatencyHistogram | None,
    handling: LatencyHistogram,
    scope: KeyScope | None,
    sample: float,
) -> Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]:
    handled = stats.handled
    # Calls started and answered OK, counted in a list (a plain list's item
    # costs less than a Counter's, a dict subclass); RpcStats folds it in.
    calls = stats.unary_calls(rule.service, rule.method)
    clock = time.perf_counter
    rnd = random.random
    access = accesslog.admission_call
    get_scope = admission_scope.get
    set_scope = admission_scope.set
    # The decision histogram's bounds are the first of the handling one's
    # (histogram.py): one bisect finds the bucket of both.
    bounds = handling.bounds
    h_counts = handling.counts
    shared = hist is not None and hist.bounds == bounds[: len(hist.bounds)]
    last = len(hist.bounds) if hist is not None else 0
    d_counts = hist.counts if hist is not None else []

    async def timed(request: Any, context: grpc.aio.ServicerContext) -> Any:
        t0 = clock()
        calls[0] += 1
        # in the call's own context (its own task); None is the default,
        # left unset unless something set another value
        if scope is not None or get_scope() is not None:
            set_scope(scope)
        try:
            response = await behavior(request, context)
        except BaseException as exc:
            code = failed_code(context, exc)
            handled[(rule.service, rule.method, code)] += 1
            handling.observe(clock() - t0)
            if sample and rnd() < sample:
                access(rule, code, clock() - t0, request)
            raise
        dt = clock() - t0
        if shared:
            i = bisect_left(bounds, dt)
            h_counts[i] += 1
            handling.total += dt
            d_counts[i if i < last else last] += 1
            hist.total += dt  # type: ignore[union-attr]
        else:
            if hist is not None:
                hist.observe(dt)
            handling.observe(dt)
        calls[1] += 1
        if sample and rnd() < sample:
            access(rule, "OK", dt, request)
        return response

    return timed


def timed_stream(
    behavior: Any,
    rule: Rule,
    stats: RpcStats,
    hist: LatencyHistogram | None,
    handling: LatencyHistogram,
    scope: KeyScope | None,
    sample: float,
    key_cache: KeyCache | None,
) -> Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]]:
    """``key_cache``: re-check the call's key per batch (admission auth on)."""
    handled = stats.handled
    key = (rule.service, rule.method)
    started, received_n, sent_n = stats.started, stats.msg_received, stats.msg_sent
    clock = time.perf_counter
    check = key_cache is not None

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
                if key_cache is not None:
                    # Checked again per batch against the in-memory key
                    # cache (an HMAC, ~1 us): a key revoked or expired
                    # while the stream is open ends it at its next batch.
                    try:
                        authorize(key_cache.authenticate(token), rule)
                    except DomainError as exc:
                        stats.auth_failures["invalid"] += 1
                        accesslog.stream_refused(rule, batches, str(exc))
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
                accesslog.admission_call(rule, code, clock() - t0, None, batches=batches)

    return timed


# ---------------------------------------------------------------- operators


def operator_handler(
    handler: grpc.RpcMethodHandler,
    rule: Rule,
    principal: Principal,
    request_id: str,
    stats: RpcStats,
) -> grpc.RpcMethodHandler:
    """The operator call's handler: timed, counted, logged, with the caller
    and the request id in its context (``current_principal``,
    ``current_request_id``) and the request id sent back in its metadata."""
    if handler.request_streaming:
        return handler  # no client-streaming operator RPCs; auth above still applied
    handled = stats.handled
    started = stats.started
    key = (rule.service, rule.method)
    handling = stats.method(rule.service, rule.method, kind(handler))

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
        accesslog.operator_call(rule, code, seconds, request_id, principal, request)

    if handler.response_streaming:
        if not inspect.isasyncgenfunction(handler.unary_stream):
            return handler  # a writer-style stream: served untimed (none today)
        stream = handler.unary_stream
        sent = stats.msg_sent

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

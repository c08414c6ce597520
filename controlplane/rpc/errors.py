"""The one place that maps domain errors to gRPC status codes."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
import structlog

from controlplane.domain.errors import (
    AlreadyExists,
    DomainError,
    FailedPrecondition,
    InvalidArgument,
    LedgerUnavailable,
    NotFound,
    PermissionDenied,
    Unauthenticated,
)

log = structlog.get_logger("burstgate.rpc")

_CODES: dict[type[DomainError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    # Auth: raised by the interceptor in controlplane/rpc/auth.py.
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    # Metering: the ledger cannot make a record durable or be read.
    LedgerUnavailable: grpc.StatusCode.UNAVAILABLE,
}


def status_for(exc: DomainError) -> grpc.StatusCode:
    for cls in type(exc).__mro__:
        code = _CODES.get(cls)
        if code is not None:
            return code
    return grpc.StatusCode.INTERNAL


R = TypeVar("R")
Handler = Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[R]]


def unary_errors(fn: Handler[R]) -> Handler[R]:
    """Turn domain errors into a status with the message; anything else into
    INTERNAL with a generic message (details go to the log, not the caller)."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> R:
        try:
            return await fn(self, request, context)
        except grpc.aio.AbortError:
            raise
        except DomainError as exc:
            await context.abort(status_for(exc), str(exc))
        except Exception:
            log.exception("unhandled error", method=fn.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, "internal error; see server log")
        raise AssertionError("unreachable: context.abort raises")

    return wrapper

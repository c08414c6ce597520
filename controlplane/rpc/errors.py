"""The one place that maps domain errors to gRPC statuses.

Every error a servicer (or the auth interceptor) ends a call with carries a
``google.rpc.Status`` in the ``grpc-status-details-bin`` trailer, with the
same code and message as the call's status (docs/api.md, "Errors"):

- ``ErrorInfo`` always: a stable ``reason`` (the table below) in
  :data:`DOMAIN`, with ``field`` (and ``batch_id`` in AdmitStream) in its
  metadata when the error names them;
- ``BadRequest`` with one ``FieldViolation`` on ``INVALID_ARGUMENT``;
- ``RetryInfo`` where retrying later can succeed (``UNAVAILABLE``; for
  ``NOT_OWNER``, 0 when the owner is known, ~100 ms otherwise).

The message text is unchanged by the details: ``"field: reason"``, and
``"batch N: field[i]: reason"`` in AdmitStream.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, NoReturn, TypeVar

import grpc
import structlog
from google.protobuf.duration_pb2 import Duration
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from controlplane.domain.errors import (
    AlreadyExists,
    DatabaseUnavailable,
    DomainError,
    FailedPrecondition,
    InvalidArgument,
    LedgerUnavailable,
    NotFound,
    Overloaded,
    PermissionDenied,
    Unauthenticated,
)
from controlplane.rpc.dbcall import UNREACHABLE

log = structlog.get_logger("burstgate.rpc")

# ErrorInfo.domain: names burstgate as the source of the reasons below.
DOMAIN = "burstgate.dev"

# Status code and ErrorInfo.reason of each domain error. The reasons are part
# of the API (docs/api.md, "Errors"): add new ones, never rename one.
_CODES: dict[type[DomainError], tuple[grpc.StatusCode, str]] = {
    InvalidArgument: (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_FIELD"),
    NotFound: (grpc.StatusCode.NOT_FOUND, "NOT_FOUND"),
    FailedPrecondition: (grpc.StatusCode.FAILED_PRECONDITION, "FAILED_PRECONDITION"),
    AlreadyExists: (grpc.StatusCode.ALREADY_EXISTS, "ALREADY_EXISTS"),
    # Auth: raised by the interceptor in controlplane/rpc/interceptor.py.
    Unauthenticated: (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED"),
    PermissionDenied: (grpc.StatusCode.PERMISSION_DENIED, "PERMISSION_DENIED"),
    # Metering: the ledger cannot make a record durable or be read.
    LedgerUnavailable: (grpc.StatusCode.UNAVAILABLE, "LEDGER_UNAVAILABLE"),
    # Operator RPCs: the database did not answer in time (controlplane/rpc/dbcall.py).
    DatabaseUnavailable: (grpc.StatusCode.UNAVAILABLE, "DATABASE_UNAVAILABLE"),
    # The cap on open reservations binds (a Complete of a request admitted offline).
    Overloaded: (grpc.StatusCode.UNAVAILABLE, "OVERLOADED"),
}
INTERNAL = (grpc.StatusCode.INTERNAL, "INTERNAL")
INTERNAL_MESSAGE = "internal error; see server log"
# RetryInfo.retry_delay by code. UNAVAILABLE is the database being
# unreachable (for the ledger: with the spool full): the writer tries the
# database again every BURSTGATE_LEDGER_RETRY_S (1 s by default), so a retry
# a second later is the first that can succeed.
_RETRY_DELAY_S: dict[grpc.StatusCode, int] = {grpc.StatusCode.UNAVAILABLE: 1}


def _code_reason(exc: DomainError) -> tuple[grpc.StatusCode, str]:
    for cls in type(exc).__mro__:
        found = _CODES.get(cls)
        if found is not None:
            return found
    return INTERNAL


def status_for(exc: DomainError) -> grpc.StatusCode:
    return _code_reason(exc)[0]


def rich_status(
    code: grpc.StatusCode,
    message: str,
    reason: str,
    *,
    field: str = "",
    description: str = "",
    metadata: Mapping[str, str] | None = None,
    retry_delay_s: float | None = None,
) -> grpc.Status:
    """``code`` and ``message`` with the ``google.rpc.Status`` trailer: an
    ErrorInfo, a BadRequest naming ``field`` (INVALID_ARGUMENT) and a
    RetryInfo (when the code is retryable)."""
    info = error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN, metadata=metadata or {})
    status = status_pb2.Status(code=code.value[0], message=message)
    status.details.add().Pack(info)
    if code == grpc.StatusCode.INVALID_ARGUMENT and field:
        violation = error_details_pb2.BadRequest.FieldViolation(
            field=field, description=description
        )
        status.details.add().Pack(error_details_pb2.BadRequest(field_violations=[violation]))
    if retry_delay_s is not None:  # the caller's own hint (NOT_OWNER: 0 or ~100 ms)
        retry = error_details_pb2.RetryInfo(
            retry_delay=Duration(nanos=round(retry_delay_s * 1e9) % 10**9,
                                 seconds=int(retry_delay_s))
        )  # fmt: skip
        status.details.add().Pack(retry)
    elif (delay := _RETRY_DELAY_S.get(code)) is not None:
        retry = error_details_pb2.RetryInfo(retry_delay=Duration(seconds=delay))
        status.details.add().Pack(retry)
    result: grpc.Status = rpc_status.to_status(status)
    return result


def error_status(exc: DomainError, *, prefix: str = "", **metadata: str) -> grpc.Status:
    """The status of a call ended by ``exc``: its message is ``prefix`` +
    ``str(exc)``; ``metadata`` goes into the ErrorInfo besides ``field``."""
    code, reason = _code_reason(exc)
    field = getattr(exc, "field", "")
    if field:
        metadata = {"field": field, **metadata}
    return rich_status(
        code,
        prefix + str(exc),
        reason,
        field=field,
        description=getattr(exc, "description", ""),
        metadata=metadata,
    )


async def abort(context: grpc.aio.ServicerContext, status: grpc.Status) -> NoReturn:
    """End the call with ``status`` (code, message and details trailer)."""
    await context.abort(status.code, status.details, status.trailing_metadata)
    raise AssertionError("unreachable: context.abort raises")


def internal_status() -> grpc.Status:
    return rich_status(INTERNAL[0], INTERNAL_MESSAGE, INTERNAL[1])


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
            await abort(context, error_status(exc))
        except UNREACHABLE as exc:  # a database call made without the DbCaller
            log.warning("database unavailable", method=fn.__name__, error=type(exc).__name__)
            await abort(context, error_status(DatabaseUnavailable()))
        except Exception:
            log.exception("unhandled error", method=fn.__name__)
            await abort(context, internal_status())

    return wrapper

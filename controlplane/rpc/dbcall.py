"""Bounded database calls for the operator APIs (AdminService, LedgerService,
operator authentication's key refresh).

A database that hangs (a network that drops packets, a server stuck on a
lock) never answers and never errors: a plain ``asyncio.to_thread`` call
would hold the operator's RPC until it came back (28 s observed). Here each
call runs on a small pool of its own threads and is awaited for at most
``timeout_s``; past it, or when the driver reports the connection lost or
refused, the RPC ends ``UNAVAILABLE`` with a generic message (the detail,
which names the database's host and port, goes to the server log only).

A call that timed out keeps its thread until the driver returns; the pool is
separate from the event loop's default executor, so hung operator calls
cannot starve anything else, and once its threads are all busy the next
calls time out in ``timeout_s`` as well. ``shutdown`` waits for them (the
engine must not be disposed under a thread that still holds a connection).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

import structlog

# exception types only: which database failures mean "unavailable"
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from controlplane.aiotime import within
from controlplane.domain.errors import DatabaseUnavailable, DomainError

log = structlog.get_logger("burstgate.db")

P = ParamSpec("P")
T = TypeVar("T")

# Errors that mean "the database is not reachable now", not "this call is
# wrong": connection refused or lost, pool exhausted by hung connections.
UNREACHABLE = (OperationalError, InterfaceError, PoolTimeout, ConnectionError)
# At most one log line per this many seconds for the same failure.
LOG_EVERY_S = 1.0


class DbCaller:
    def __init__(self, timeout_s: float, *, workers: int = 4) -> None:
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="operator-db")
        self.failures = 0
        self._logged_at = 0.0
        self._suppressed = 0

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """``fn(*args, **kwargs)`` on a database thread, bounded; raises
        ``DatabaseUnavailable`` on a timeout or an unreachable database."""
        loop = asyncio.get_running_loop()
        job = loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))
        try:
            return await within(asyncio.shield(job), self.timeout_s)
        except DomainError:
            raise
        except TimeoutError:
            job.add_done_callback(_swallow)  # it may still finish; nobody waits
            self._failed(fn, f"no answer within {self.timeout_s} s")
            raise DatabaseUnavailable() from None
        except UNREACHABLE as exc:
            self._failed(fn, _first_line(exc))
            raise DatabaseUnavailable() from exc

    def _failed(self, fn: Callable[..., Any], detail: str) -> None:
        self.failures += 1
        now = time.monotonic()
        if now - self._logged_at < LOG_EVERY_S:
            self._suppressed += 1
            return
        log.warning(
            "database unavailable for an operator call",
            call=getattr(fn, "__qualname__", repr(fn)),
            error=detail,
            suppressed=self._suppressed,
        )
        self._logged_at, self._suppressed = now, 0

    def shutdown(self) -> None:
        """Wait for every call still running (blocking: run in a thread)."""
        self._pool.shutdown(wait=True, cancel_futures=True)


def _first_line(exc: BaseException) -> str:
    text = str(getattr(exc, "orig", None) or exc)
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def _swallow(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()

"""The background loops' database calls: each on a worker thread, awaited
for a bounded time, and all of them waited for before the engine is
disposed of. Operator RPCs have their own bounded pool (rpc/dbcall.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from controlplane.aiotime import within

T = TypeVar("T")


class LoopCalls:
    """``run(fn)``: ``fn()`` on a worker thread, for database work of the poll
    loop, awaited for at most ``timeout_s`` (a hung database makes the step
    fail, logged, instead of holding the loop's later steps). A cancelled or
    timed-out caller does not stop the thread, which keeps its pooled
    connection until it returns; ``finish`` waits for these, so the server
    can dispose of the engine after it and no connection is handed back to
    a disposed pool (and later garbage-collected still open)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._pending: set[asyncio.Future[Any]] = set()

    async def run(self, fn: Callable[[], T]) -> T:
        fut = asyncio.ensure_future(asyncio.to_thread(fn))
        self._pending.add(fut)
        fut.add_done_callback(self._pending.discard)
        fut.add_done_callback(_swallow)
        try:
            return await within(asyncio.shield(fut), self.timeout_s)
        except TimeoutError:
            raise TimeoutError(f"no answer from the database within {self.timeout_s} s") from None

    async def finish(self) -> None:
        """Wait for the calls still on a thread (a poll step cancelled mid-query)."""
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)


def _swallow(fut: asyncio.Future[Any]) -> None:
    """Retrieve a background call's exception (logged by whoever awaited it,
    or nobody, after a timeout), so asyncio does not report it as lost."""
    if not fut.cancelled():
        fut.exception()

"""Blocking database calls awaited for a bounded time.

Each call runs on a daemon thread of its own, not the loop's executor: a
call stuck on a hung database must neither stall the coordinator's loop nor
keep the process from exiting. After the bound the caller goes on (its
lease deadlines keep running on the clock); the call may still finish on
its thread, which the lease protocol tolerates (an unseen acquire expires,
or is re-taken with a higher epoch). ``controlplane.store.replica_lock`` has
the same helper; it goes when the replica lock does (issue 16, step 2).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from controlplane.aiotime import within

T = TypeVar("T")


async def call(fn: Callable[..., T], *args: Any, wait_s: float, what: str) -> T:
    """``fn(*args)`` on a daemon thread; its result, its exception, or
    TimeoutError after ``wait_s`` (the thread is left to finish)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[tuple[bool, Any]] = loop.create_future()

    def settle(outcome: tuple[bool, Any]) -> None:
        if not fut.done():
            fut.set_result(outcome)

    def run() -> None:
        outcome: tuple[bool, Any]
        try:
            outcome = (True, fn(*args))
        except BaseException as exc:
            outcome = (False, exc)
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            loop.call_soon_threadsafe(settle, outcome)

    threading.Thread(target=run, name=f"ha-{what}", daemon=True).start()
    try:
        ok, value = await within(asyncio.shield(fut), wait_s)
    except TimeoutError:
        raise TimeoutError(f"{what}: no answer from the database within {wait_s:g} s") from None
    if not ok:
        raise value
    result: T = value
    return result

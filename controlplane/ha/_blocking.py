"""Blocking database calls of the coordinator, awaited for a bounded time
(``controlplane.aiotime.in_daemon_thread``: a daemon thread per call). After
the bound the caller goes on (its lease deadlines keep running on the
clock); the call may still finish on its thread, which the lease protocol
tolerates (an unseen acquire expires, or is re-taken with a higher epoch).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from controlplane.aiotime import bounded, in_daemon_thread

T = TypeVar("T")


async def call(fn: Callable[..., T], *args: Any, wait_s: float, what: str) -> T:
    """``fn(*args)`` on a daemon thread; its result, its exception, or
    TimeoutError after ``wait_s`` (the thread is left to finish)."""
    result: T = await bounded(in_daemon_thread(lambda: fn(*args), f"ha-{what}"), wait_s, what)
    return result

"""``within``: ``asyncio.wait_for`` without its Python 3.11 race.

In 3.11 ``wait_for`` can swallow the caller's cancellation when it arrives
just as the awaited thing completes (CPython gh-86296, fixed in 3.12 by
rebuilding ``wait_for`` on ``asyncio.timeout``): the result is returned and
the task carries on as if never cancelled. A server loop cancelled by
``ControlPlane.stop`` then kept polling, and the stop waited for it for
ever (an intermittent hang the tests reported). ``asyncio.timeout`` has no
such window.

``in_daemon_thread`` and ``bounded``: a blocking (database) call on a daemon
thread of its own, awaited for a bounded time. Not the loop's executor: a
call stuck on a hung database must neither stall a server loop nor keep the
process from exiting; after the bound the caller goes on and the call may
still finish on its thread (the replica lock and the cell coordinator both
tolerate that).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")


async def within(aw: Awaitable[T], timeout_s: float | None) -> T:
    """``await aw`` for at most ``timeout_s`` (None: no bound); TimeoutError
    after it, ``aw`` cancelled (shield it to let it run on)."""
    async with asyncio.timeout(timeout_s):
        return await aw


def in_daemon_thread(fn: Callable[[], Any], name: str) -> asyncio.Future[tuple[bool, Any]]:
    """``fn()`` on a daemon thread; the future gets (True, result) or (False,
    exception), never an exception of its own (nobody may be waiting)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[tuple[bool, Any]] = loop.create_future()

    def settle(outcome: tuple[bool, Any]) -> None:
        if not fut.done():
            fut.set_result(outcome)

    def run() -> None:
        outcome: tuple[bool, Any]
        try:
            outcome = (True, fn())
        except BaseException as exc:
            outcome = (False, exc)
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            loop.call_soon_threadsafe(settle, outcome)

    threading.Thread(target=run, name=name, daemon=True).start()
    return fut


async def bounded(fut: asyncio.Future[tuple[bool, Any]], wait_s: float, what: str) -> Any:
    """The outcome of an ``in_daemon_thread`` future: its result, its
    exception, or TimeoutError after ``wait_s`` (the thread runs on)."""
    try:
        ok, value = await within(asyncio.shield(fut), wait_s)
    except TimeoutError:
        raise TimeoutError(f"{what}: no answer from the database within {wait_s:g} s") from None
    if not ok:
        raise value
    return value

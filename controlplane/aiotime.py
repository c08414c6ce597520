"""``within``: ``asyncio.wait_for`` without its Python 3.11 race.

In 3.11 ``wait_for`` can swallow the caller's cancellation when it arrives
just as the awaited thing completes (CPython gh-86296, fixed in 3.12 by
rebuilding ``wait_for`` on ``asyncio.timeout``): the result is returned and
the task carries on as if never cancelled. A server loop cancelled by
``ControlPlane.stop`` then kept polling, and the stop waited for it for
ever (an intermittent hang the tests reported). ``asyncio.timeout`` has no
such window."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def within(aw: Awaitable[T], timeout_s: float | None) -> T:
    """``await aw`` for at most ``timeout_s`` (None: no bound); TimeoutError
    after it, ``aw`` cancelled (shield it to let it run on)."""
    async with asyncio.timeout(timeout_s):
        return await aw

"""Time as a dependency: a clock and a sleep, real or manual.

The service layer reads time only through an injected ``Clock`` (integer
nanoseconds since the epoch), and the server's background loops (expiry,
config poll) wait only through an injected ``Sleep``. Production uses the
real ones; tests, replays and simulations use ``ManualClock``, whose time
moves only when ``advance`` is called, and which wakes the loops sleeping on
it at the simulated moment, so nothing waits in real time.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Awaitable, Callable

from controlplane.domain.units import NS_PER_S

Clock = Callable[[], int]
Sleep = Callable[[float], Awaitable[None]]


real_clock: Clock = time.time_ns
real_sleep: Sleep = asyncio.sleep


class ManualClock:
    """A clock that moves only when told, and a sleep that follows it.

    ``clock()`` is the ``Clock``; ``sleep`` the ``Sleep``. ``advance`` moves
    time forward and resolves, in time order, the sleeps that are due; a
    sleeper runs when the event loop next gets control (``await
    asyncio.sleep(0)`` or ``await clock.settle()`` in a test)."""

    def __init__(self, start_ns: int = 1_700_000_000 * NS_PER_S) -> None:
        self.now_ns = start_ns
        self._sleepers: list[tuple[int, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def __call__(self) -> int:
        return self.now_ns

    def clock(self) -> int:
        return self.now_ns

    async def sleep(self, seconds: float) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        wake = self.now_ns + max(0, int(seconds * NS_PER_S))
        heapq.heappush(self._sleepers, (wake, next(self._seq), fut))
        await fut

    @property
    def sleepers(self) -> int:
        """Sleeps not yet due (cancelled ones included until they come due)."""
        return len(self._sleepers)

    def advance(self, seconds: float) -> None:
        """Move time forward by ``seconds`` and wake every sleep due by then."""
        if seconds < 0:
            raise ValueError(f"seconds: time does not go back ({seconds})")
        self.now_ns += int(seconds * NS_PER_S)
        heap = self._sleepers
        while heap and heap[0][0] <= self.now_ns:
            _, _, fut = heapq.heappop(heap)
            if not fut.done():
                fut.set_result(None)

    async def settle(self, turns: int = 5) -> None:
        """Give the event loop a few turns, so woken sleepers run."""
        for _ in range(turns):
            await asyncio.sleep(0)

"""Callers' deadlines: one loop timer for all of them.

Each ``admit`` has a deadline; a loop timer per call costs more than the
rest of the call's bookkeeping (a TimerHandle, and with uvloop a libuv timer
started and stopped). So the deadlines go on a heap and one timer is armed
at the earliest; when it fires, every caller whose deadline has come and who
is still waiting is expired (``expire(entry, future)``), and the timer is
armed at the next. Callers answered earlier stay on the heap until their
deadline passes (lazy deletion) and are skipped; the heap is rebuilt from
the waiting ones when it holds more than twice as many (long deadlines at
high rates).

A deadline may fire up to ``EARLY_S`` early: loop timers are rounded (libuv
to whole milliseconds), and re-arming for the last sub-millisecond would
spin. Early, never late: the deadline bounds the call.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from collections.abc import Callable

from burstgate_client.sdk.entries import Entry
from burstgate_client.sdk.model import Admission

EARLY_S = 0.0005
COMPACT_MIN = 4096

Item = tuple[float, int, Entry, "asyncio.Future[Admission]"]


class Deadlines:
    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        expire: Callable[[Entry, asyncio.Future[Admission]], None],
    ) -> None:
        self._loop, self._expire = loop, expire
        self._heap: list[Item] = []
        self._seq = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._armed_at = math.inf
        self._compact_at = COMPACT_MIN

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, at: float, entry: Entry, fut: asyncio.Future[Admission]) -> None:
        """Expire ``fut`` (of ``entry``) at loop time ``at`` unless answered."""
        heapq.heappush(self._heap, (at, next(self._seq), entry, fut))
        if at < self._armed_at:
            self._arm(at)

    def _arm(self, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._armed_at = at
        self._timer = self._loop.call_at(at, self._fire)

    def _fire(self) -> None:
        self._timer, self._armed_at = None, math.inf
        heap = self._heap
        now = self._loop.time() + EARLY_S
        while heap and (heap[0][0] <= now or heap[0][3].done()):
            _, _, entry, fut = heapq.heappop(heap)
            if not fut.done():
                self._expire(entry, fut)
        if len(heap) > self._compact_at:
            heap[:] = [item for item in heap if not item[3].done()]
            heapq.heapify(heap)
            self._compact_at = max(COMPACT_MIN, 2 * len(heap))
        if heap:
            self._arm(heap[0][0])

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

"""WaitingRoom, the asyncio layer over the admission queues, on a real event
loop against a real AdmissionService, without gRPC.

The loop's clock is the service's fake clock (``VirtualTimeLoop``), so the
room's timer fires exactly when a test advances the clock past the moment it
was armed for; nothing here sleeps in real time. After moving the clock a
test yields to the loop (``run_pending``), which runs every callback and timer
due by then.

Lanes (tests/unit/service/conftest.py) with the default policy: a premium
request waits at most 0.75 x its 1 s TTFT SLO = 750 ms, standard 2.25 s.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from contextvars import Context
from typing import Any, TypeVar

import pytest

from controlplane.domain import AdmitDecision, Decision
from controlplane.domain.units import NS_PER_MS, NS_PER_S
from controlplane.service import AdmissionService
from controlplane.service.waiting import WaitingRoom
from fastpath import Reason

from .conftest import tenant

MS = NS_PER_MS

T = TypeVar("T")


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose ``time()`` is the fake clock, in seconds since the
    loop was made (small numbers, so a timer armed for a nanosecond deadline
    is due at exactly that nanosecond). It records every timer scheduled."""

    def __init__(self, clock: Callable[[], int]) -> None:
        super().__init__()
        self._clock = clock
        self._origin_ns = clock()
        self.timers: list[asyncio.TimerHandle] = []
        # what the loop reports instead of logging it (a failing callback)
        self.errors: list[dict[str, Any]] = []
        self.set_exception_handler(lambda _loop, ctx: self.errors.append(ctx))

    def time(self) -> float:
        return (self._clock() - self._origin_ns) / NS_PER_S

    def call_at(  # type: ignore[override]
        self,
        when: float,
        callback: Callable[..., object],
        *args: Any,
        context: Context | None = None,
    ) -> asyncio.TimerHandle:
        handle = super().call_at(when, callback, *args, context=context)
        self.timers.append(handle)
        return handle

    def pending_timers(self) -> list[float]:
        """When the timers not yet due and not cancelled will fire (seconds
        from the loop's origin)."""
        now = self.time()
        return sorted(h.when() for h in self.timers if not h.cancelled() and h.when() > now)


@pytest.fixture
def run(clock: Any) -> Any:
    """Run a test coroutine on a fresh VirtualTimeLoop."""

    def run(body: Callable[[VirtualTimeLoop], Coroutine[Any, Any, T]]) -> T:
        loop = VirtualTimeLoop(clock)
        with asyncio.Runner(loop_factory=lambda: loop) as runner:
            return runner.run(body(loop))

    return run


async def run_pending(rounds: int = 10) -> None:
    """Let the loop run what is ready and the timers due by now."""
    for _ in range(rounds):
        await asyncio.sleep(0)


@pytest.fixture
def room(make_service: Callable[..., AdmissionService]) -> WaitingRoom:
    """A room over a service where acme may run one request at a time: a
    second one waits for the slot."""
    return WaitingRoom(make_service(tenant(max_concurrency=1)))


def admit(room: WaitingRoom, rid: str, lane: str = "") -> Coroutine[Any, Any, AdmitDecision]:
    return room.admit("acme", rid, lane, 10, 10, "", "", timeout_s=None)


def queued(svc: AdmissionService) -> int:
    assert svc.waiting == sum(svc.views.queue_depths().values())
    return svc.waiting


def test_a_waiter_is_admitted_when_capacity_frees(room: WaitingRoom, clock: Any, run: Any) -> None:
    svc = room.service

    async def body(loop: VirtualTimeLoop) -> None:
        first = await admit(room, "a")  # a free slot: answered without waiting
        assert first.decision == Decision.ADMIT
        second = asyncio.create_task(admit(room, "b"))
        await run_pending()
        assert not second.done() and queued(svc) == 1
        clock.advance(10 * MS)
        await run_pending()
        assert not second.done()  # time alone frees no slot
        svc.complete("acme", "a", first.reservation_id, 10, 5)
        await run_pending()
        assert second.done()
        d = second.result()
        assert (d.decision, d.request_id, d.queue_wait_ns) == (Decision.ADMIT, "b", 10 * MS)
        assert queued(svc) == 0

    run(body)


def test_the_timer_ends_a_wait_at_its_deadline_with_queue_timeout(
    room: WaitingRoom, clock: Any, run: Any
) -> None:
    svc = room.service

    async def body(loop: VirtualTimeLoop) -> None:
        await admit(room, "a", "premium")
        waiter = asyncio.create_task(admit(room, "b", "premium"))
        await run_pending()
        # armed for the 750 ms deadline (0.75 x its 1 s SLO)
        assert loop.pending_timers() == [pytest.approx(0.75)]
        clock.advance(749 * MS)
        await run_pending()
        assert not waiter.done()
        clock.advance(1 * MS)
        await run_pending()  # nobody calls tick(): only the timer can end the wait
        assert waiter.done()
        d = waiter.result()
        assert (d.decision, d.reason, d.queue_wait_ns) == (
            Decision.REJECT,
            Reason.QUEUE_TIMEOUT,
            750 * MS,
        )
        assert queued(svc) == 0 and svc.next_wakeup_ns() is None
        assert loop.pending_timers() == []  # nothing left to wake up for

    run(body)


def test_an_earlier_wakeup_rearms_the_timer(room: WaitingRoom, clock: Any, run: Any) -> None:
    svc = room.service

    async def body(loop: VirtualTimeLoop) -> None:
        await admit(room, "a")
        late = asyncio.create_task(admit(room, "late", "standard"))  # deadline +2.25 s
        await run_pending()
        assert loop.pending_timers() == [pytest.approx(2.25)]
        early = asyncio.create_task(admit(room, "early", "premium"))  # deadline +750 ms
        await run_pending()
        assert loop.pending_timers() == [pytest.approx(0.75)]  # moved, not doubled
        clock.advance(750 * MS)
        await run_pending()
        assert early.done() and early.result().reason == Reason.QUEUE_TIMEOUT
        assert not late.done() and queued(svc) == 1
        # the firing timer armed the next one, for the remaining deadline
        assert loop.pending_timers() == [pytest.approx(2.25)]
        clock.advance(1500 * MS)
        await run_pending()
        assert late.done() and late.result().reason == Reason.QUEUE_TIMEOUT

    run(body)


def test_a_later_wakeup_leaves_the_armed_timer_alone(
    room: WaitingRoom, clock: Any, run: Any
) -> None:

    async def body(loop: VirtualTimeLoop) -> None:
        await admit(room, "a")
        early = asyncio.create_task(admit(room, "early", "premium"))  # deadline +750 ms
        await run_pending()
        armed = len(loop.timers)
        assert loop.pending_timers() == [pytest.approx(0.75)]
        late = asyncio.create_task(admit(room, "late", "standard"))  # deadline +2.25 s
        await run_pending()
        assert len(loop.timers) == armed  # no timer scheduled (nor cancelled) for it
        assert loop.pending_timers() == [pytest.approx(0.75)]
        clock.advance(750 * MS)
        await run_pending()
        assert early.done() and early.result().reason == Reason.QUEUE_TIMEOUT
        assert not late.done()
        late.cancel()
        await run_pending()

    run(body)


def test_cancelling_the_caller_takes_its_waiter_out_of_the_queue(
    room: WaitingRoom, clock: Any, run: Any
) -> None:
    svc = room.service

    async def body(loop: VirtualTimeLoop) -> None:
        first = await admit(room, "a")
        stay = asyncio.create_task(admit(room, "stay", "standard"))
        leave = asyncio.create_task(admit(room, "leave", "premium"))
        await run_pending()
        assert queued(svc) == 2
        depths = svc.views.queue_depths()
        assert (depths.get("premium"), depths.get("standard")) == (1, 1)
        assert loop.pending_timers() == [pytest.approx(0.75)]
        leave.cancel()
        await run_pending()
        assert leave.cancelled()
        assert queued(svc) == 1 and svc.views.queue_depths().get("premium", 0) == 0
        assert svc.stats.cancelled_total == 1
        # The timer armed for the cancelled call may stay (an early wake-up
        # is harmless): at 750 ms it finds nothing due and re-arms for the
        # waiter that is left.
        clock.advance(750 * MS)
        await run_pending()
        assert not stay.done() and loop.pending_timers() == [pytest.approx(2.25)]
        # the freed place goes to the call that stayed
        svc.complete("acme", "a", first.reservation_id, 10, 5)
        await run_pending()
        assert stay.done() and stay.result().decision == Decision.ADMIT
        assert queued(svc) == 0

    run(body)


def test_a_failing_tick_still_rearms_the_timer(
    room: WaitingRoom, clock: Any, run: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    svc = room.service
    real_tick = svc.tick
    calls: list[int] = []

    def tick_failing_once() -> None:
        calls.append(clock())
        if len(calls) == 1:
            raise RuntimeError("tick failed")
        real_tick()

    monkeypatch.setattr(svc, "tick", tick_failing_once)

    async def body(loop: VirtualTimeLoop) -> None:
        await admit(room, "a", "premium")
        waiter = asyncio.create_task(admit(room, "b", "premium"))
        await run_pending()
        clock.advance(750 * MS)
        await run_pending()
        # the first tick raised (reported to the loop's exception handler),
        # the timer was armed again at once and the second tick timed out
        # the waiter: nobody is left waiting past the deadline
        assert len(calls) == 2
        assert [type(e.get("exception")) for e in loop.errors] == [RuntimeError]
        assert waiter.done() and waiter.result().reason == Reason.QUEUE_TIMEOUT
        assert queued(svc) == 0

    run(body)

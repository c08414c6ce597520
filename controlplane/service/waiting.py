"""Server-side waiting on the asyncio event loop.

The admission service decides and orders synchronously (and is tested that
way with an injected clock); this layer turns a queued ``Waiter`` into an
awaitable, keeps one timer armed for the next moment time alone can change
something (a refill, a deadline), and takes a cancelled call out of its queue
at once.
"""

from __future__ import annotations

import asyncio

from controlplane.domain import AdmitDecision
from controlplane.domain.scope import KeyScope
from controlplane.domain.units import NS_PER_S
from controlplane.service.admission import AdmissionService
from controlplane.service.queueing import Waiter
from controlplane.service.tenants import Route


class WaitingRoom:
    def __init__(self, service: AdmissionService) -> None:
        self.service = service
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: int | None = None

    async def admit(
        self,
        tenant_id: str,
        request_id: str,
        lane: str,
        prompt_tokens: int,
        max_tokens: int,
        model: str,
        pool: str,
        *,
        timeout_s: float | None,
        scope: KeyScope | None = None,
        retry_key: str = "",
        attempt: int = 0,
        route: Route | None = None,
    ) -> AdmitDecision:
        """``route``: as ``AdmissionService.admit_or_wait``'s."""
        out = self.decide(
            tenant_id, request_id, lane, prompt_tokens, max_tokens, model, pool,
            timeout_s=timeout_s, scope=scope, retry_key=retry_key, attempt=attempt, route=route,
        )  # fmt: skip
        if isinstance(out, AdmitDecision):
            return out
        return await self.wait(out)

    def decide(
        self,
        tenant_id: str,
        request_id: str,
        lane: str,
        prompt_tokens: int,
        max_tokens: int,
        model: str,
        pool: str,
        *,
        timeout_s: float | None,
        scope: KeyScope | None = None,
        retry_key: str = "",
        attempt: int = 0,
        route: Route | None = None,
    ) -> AdmitDecision | Waiter:
        """:meth:`admit` up to the wait: the answer when it is immediate,
        else the queued ``Waiter`` to hand to :meth:`wait` (at once: its
        timer is armed). A caller that is answered at once never creates
        a coroutine or a future for it."""
        svc = self.service
        deadline = None if timeout_s is None else svc.clock() + int(timeout_s * NS_PER_S)
        out = svc.admit_or_wait(
            tenant_id, request_id, lane, prompt_tokens, max_tokens, model, pool,
            deadline_ns=deadline, scope=scope, retry_key=retry_key, attempt=attempt, route=route,
        )  # fmt: skip
        # With nothing queued and no timer armed an immediate answer has no
        # wake-up to move (next_wakeup_ns is None then): no reschedule.
        if self._timer is not None or svc.waiting:
            self.reschedule()
        return out

    async def wait(self, waiter: Waiter) -> AdmitDecision:
        """The answer of a request :meth:`decide` queued."""
        fut: asyncio.Future[AdmitDecision] = asyncio.get_running_loop().create_future()

        def done(decision: AdmitDecision) -> None:
            if not fut.done():  # the caller may have been cancelled meanwhile
                fut.set_result(decision)

        waiter.on_done = done
        try:
            return await fut
        except asyncio.CancelledError:
            # The caller cancelled or its deadline passed: leave the queue now.
            self.service.cancel(waiter)
            self.reschedule()
            raise

    @property
    def timer_armed(self) -> bool:
        return self._timer is not None

    def reschedule(self) -> None:
        """Arm the timer for the service's next wake-up (call after anything
        that may have changed the queues)."""
        wake = self.service.next_wakeup_ns()
        if wake is None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = self._timer_at = None
            return
        if self._timer is not None and self._timer_at is not None and self._timer_at <= wake:
            return  # an earlier (or the same) wake-up is already armed
        if self._timer is not None:
            self._timer.cancel()
        delay = max(0.0, (wake - self.service.clock()) / NS_PER_S)
        self._timer_at = wake
        self._timer = asyncio.get_running_loop().call_later(delay, self._fire)

    def _fire(self) -> None:
        self._timer = self._timer_at = None
        try:
            self.service.tick()
        finally:
            # even if a tick fails (it is logged by the loop), the waiters
            # keep their timer: nobody is left waiting past their deadline
            self.reschedule()

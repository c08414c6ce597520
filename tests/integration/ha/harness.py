"""In-process replicas for the coordinator tests: each member has its own
engine (its own connections, as a process would) on one shared database,
and can be paused like SIGSTOP (its tick loop and its database calls stop
where they are, its clock keeps running), killed like kill -9 (its task
cancelled, nothing released) or drained like SIGTERM.

``Checker`` watches every member's ``owns()`` on the shared monotonic clock
and collects every validity interval, to show that no cell ever had two
owners at once."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine

from controlplane.ha.coordinator import Coordinator, Interval
from controlplane.store.db import make_engine
from controlplane.store.leases import HaStore


class PausableStore(HaStore):
    """The real store; while ``gate`` is clear every call waits before it is
    sent and again before its answer is returned (a process stopped at
    either point)."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self.gate = threading.Event()
        self.gate.set()

    def _through(self, fn: Callable[..., Any], *args: Any) -> Any:
        self.gate.wait(timeout=60)
        result = fn(*args)
        self.gate.wait(timeout=60)
        return result

    def heartbeat(self, member_id: str, address: str, draining: bool = False) -> None:
        self._through(super().heartbeat, member_id, address, draining)

    def live_members(self, member_ttl_s: float) -> list[str]:
        got: list[str] = self._through(super().live_members, member_ttl_s)
        return got

    def acquire(self, cell: str, me: str, ttl_s: float) -> int | None:
        got: int | None = self._through(super().acquire, cell, me, ttl_s)
        return got

    def renew(self, cell: str, me: str, epoch: int, ttl_s: float) -> bool:
        return bool(self._through(super().renew, cell, me, epoch, ttl_s))

    def release(self, cell: str, me: str, epoch: int) -> bool:
        return bool(self._through(super().release, cell, me, epoch))


class Member:
    def __init__(
        self, url: str, name: str, cells: list[str], *, ttl_s: float, margin_s: float
    ) -> None:
        self.name = name
        self.engine = make_engine(url)
        self.store = PausableStore(self.engine)
        self._running = asyncio.Event()
        self._running.set()
        self.coord = Coordinator(
            self.store, name, f"{name}.test:50051", cells,
            ttl_s=ttl_s, margin_s=margin_s, sleep=self._sleep,
        )  # fmt: skip
        self.killed = False

    async def _sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
        await self._running.wait()

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    def start(self) -> None:
        self.coord.start()

    def pause(self) -> None:
        self._running.clear()
        self.store.gate.clear()

    def resume(self) -> None:
        self.store.gate.set()
        self._running.set()

    async def kill(self) -> None:
        """kill -9: the loop stops, nothing is released; owns() still answers
        by the clock (what a dead process decided stays counted until then)."""
        self.killed = True
        await self.coord.stop()
        self.resume()  # let calls stuck at the gate finish on their threads

    async def drain(self) -> None:
        await self.coord.drain()
        self.killed = True

    def close(self) -> None:
        self.resume()
        self.engine.dispose()


class Checker:
    """Samples every member's owns() for every cell; a sample with two
    owners of one cell is a violation. ``intervals()`` adds the exact
    validity intervals from the coordinators' histories."""

    def __init__(self, members: list[Member], cells: list[str]) -> None:
        self.members = members  # every member ever started (killed ones too)
        self.cells = cells
        self.samples = 0
        self.violations: list[tuple[float, str, list[str]]] = []
        self._task: asyncio.Task[None] | None = None

    def sweep(self) -> None:
        now = time.monotonic()
        for cell in self.cells:
            holders = [m.name for m in self.members if m.coord.owns(cell) is not None]
            if len(holders) > 1:
                self.violations.append((now, cell, holders))
        self.samples += 1

    async def _run(self) -> None:
        while True:
            self.sweep()
            await asyncio.sleep(0.005)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def intervals(self) -> list[Interval]:
        out: list[Interval] = []
        for m in self.members:
            out.extend(m.coord.history)
            for cell, lease in m.coord.leases().items():  # still open: valid to its deadline
                out.append(
                    Interval(cell, m.name, lease.epoch, lease.valid_from, lease.deadline, "open")
                )
        return out


def overlaps(intervals: list[Interval]) -> list[tuple[Interval, Interval]]:
    """Pairs of intervals of one cell, of different leases, valid at once;
    also (as a pair with itself) any lease whose epoch is not above the one
    before it in time."""
    bad: list[tuple[Interval, Interval]] = []
    by_cell: dict[str, list[Interval]] = {}
    for iv in intervals:
        by_cell.setdefault(iv.cell, []).append(iv)
    for ivs in by_cell.values():
        ivs.sort(key=lambda iv: iv.valid_from)
        for i, a in enumerate(ivs):
            for b in ivs[i + 1 :]:
                if (a.member, a.epoch) == (b.member, b.epoch):
                    bad.append((a, b))  # one lease recorded twice: never expected
                elif b.valid_from < a.valid_until:
                    bad.append((a, b))
                elif b.epoch <= a.epoch:
                    bad.append((a, b))  # the fencing token went backwards in time
    return bad


async def until(predicate: Callable[[], bool], message: str, timeout: float = 30.0) -> float:
    """Wait (on the loop) until ``predicate()``; the seconds it took."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {message}")
        await asyncio.sleep(0.01)
    return time.monotonic() - start


def no_takeover_holds(planes: list[Any]) -> bool:
    """No running plane's gate holds a pool after a takeover any more
    (``AdmissionService.views.pool_holds``): the handed-off cells decide again."""
    return not any(p.srv.on_loop(p.srv.plane.service.views.pool_holds)
                   for p in planes if p.srv is not None)  # fmt: skip

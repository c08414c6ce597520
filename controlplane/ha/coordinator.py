"""One replica's side of cell ownership: heartbeat, renew, acquire, hand
off, self-fence, drain (docs/ha.md).

Every ``tick_s`` (default ttl/3) the coordinator
1. heartbeats its member row;
2. renews every lease it holds;
3. computes the rendezvous assignment of its cells over the live members
   (heartbeat within ``ttl_s``, not draining);
4. releases the cells it holds that are assigned to another live member
   (a handoff: that member acquires them on its next tick);
5. acquires the cells assigned to it that are free or expired.

**Self-fencing.** A lease is valid locally only until
``t_sent + ttl_s - margin_s``, where ``t_sent`` is this replica's monotonic
clock read *before* the acquire or renew statement was sent. The database
sets ``expires_at`` at or after that moment plus ``ttl_s`` by its own clock,
and lets nobody else acquire before ``expires_at``; so as long as the two
clocks' rates differ by less than ``margin_s`` over ``ttl_s``, this replica
stops deciding before anyone else can start. ``owns(cell)`` checks the clock
on every call: a replica whose loop is stuck (a pause, a hung database call,
SIGSTOP) stops owning on time, and ``on_lost`` fires then.

**A lone member** (the last live-member list it read names only itself)
takes and renews its leases for ``lone_ttl_s`` instead of ``ttl_s``: with
nobody to fail over to, a database outage shorter than that (less the
margin) costs it nothing, and the arithmetic above is the same with the
longer TTL. A renew is sent with the TTL in force at the time; before it is
sent the local deadline drops to what that renew would allow (a shorter
renew whose answer is lost may still have shortened the lease in the
database). docs/ha.md, "Database outages".

Every DB call runs on a daemon thread, awaited at most ``call_wait_s``.
Callbacks (``on_acquired(cell, epoch)``, ``on_lost(cell, epoch, why)``) run
on the loop; their exceptions are logged, never raised into the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import structlog

from controlplane.domain.rendezvous import assignment
from controlplane.ha import _blocking, trace
from controlplane.store.leases import HaStore

log = structlog.get_logger("burstgate.ha")

# Why a lease ended (``on_lost``'s ``why``, ``Interval.why``).
EXPIRED = "expired"  # not renewed in time: self-fenced by the clock
REFUSED = "refused"  # the database refused the renew (not ours any more)
HANDOFF = "handoff"  # released to the live member it is assigned to now
REMOVED = "removed"  # the cell is not one of ours any more (set_cells)
DRAIN = "drain"  # released by drain()


@dataclass
class Lease:
    """A lease held locally: valid from ``valid_from`` until ``deadline``
    (both on the coordinator's clock)."""

    epoch: int
    valid_from: float
    deadline: float


@dataclass(frozen=True)
class Interval:
    """A closed validity interval of one lease, as ``owns()`` answered it."""

    cell: str
    member: str
    epoch: int
    valid_from: float
    valid_until: float
    why: str


def _noop_acquired(cell: str, epoch: int) -> None:
    pass


def _noop_lost(cell: str, epoch: int, why: str) -> None:
    pass


class Coordinator:
    def __init__(
        self,
        store: HaStore,
        member_id: str,
        address: str,
        cells: Iterable[str],
        *,
        ttl_s: float = 5.0,
        margin_s: float = 1.0,
        lone_ttl_s: float | None = None,
        tick_s: float | None = None,
        call_wait_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
        on_acquired: Callable[[str, int], None] = _noop_acquired,
        on_lost: Callable[[str, int, str], None] = _noop_lost,
        history: int = 1024,
    ) -> None:
        if not member_id:
            raise ValueError("member_id must be non-empty")
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s!r}")
        if not 0 <= margin_s < ttl_s:
            raise ValueError(f"margin_s must be in [0, ttl_s={ttl_s:g}), got {margin_s!r}")
        tick = ttl_s / 3 if tick_s is None else tick_s
        if not 0 < tick < ttl_s - margin_s:
            # A renew every tick must land before the local validity runs out.
            raise ValueError(
                f"tick_s must be in (0, ttl_s - margin_s = {ttl_s - margin_s:g}), got {tick!r}"
            )
        self.store = store
        self.member_id = member_id
        self.address = address
        self.ttl_s, self.margin_s, self.tick_s = float(ttl_s), float(margin_s), float(tick)
        # No shorter than ttl_s: a lone member never holds a lease for less.
        self.lone_ttl_s = max(self.ttl_s, float(lone_ttl_s or 0.0))
        self.call_wait_s = float(ttl_s if call_wait_s is None else call_wait_s)
        self._cells = sorted(set(cells))
        self._clock, self._sleep = clock, sleep
        self._on_acquired, self._on_lost = on_acquired, on_lost
        self._leases: dict[str, Lease] = {}
        self._to_release: dict[str, int] = {}  # lost locally, maybe still ours in the DB
        self._draining = False
        self._tick_lock = asyncio.Lock()
        self._wake = asyncio.Event()  # wake(): tick now instead of at the next tick_s
        self.task: asyncio.Task[None] | None = None
        self.history: deque[Interval] = deque(maxlen=history)
        self.counts: Counter[str] = Counter()  # acquired, and losses by why
        self.members: list[str] = []  # live members at the last tick

    # --- queries (on the loop) ---

    def owns(self, cell: str) -> int | None:
        """The epoch of our lease of ``cell`` while it is valid on our clock,
        else None (and, the first time after its deadline, ``on_lost``)."""
        lease = self._leases.get(cell)
        if lease is None:
            return None
        if self._clock() < lease.deadline:
            return lease.epoch
        self._lose(cell, EXPIRED)
        return None

    def owned(self) -> dict[str, int]:
        """Every cell we own now -> its epoch."""
        return {c: e for c in list(self._leases) if (e := self.owns(c)) is not None}

    def leases(self) -> dict[str, Lease]:
        """The leases held locally (not checked against the clock)."""
        return dict(self._leases)

    @property
    def lone(self) -> bool:
        """The live members of the last tick that read them were this one alone."""
        return self.members == [self.member_id]

    def lease_ttl(self) -> float:
        """The TTL an acquire or renew sent now asks for (and a tenant share:
        ha/shares.py): ``lone_ttl_s`` while this member is lone, else ``ttl_s``."""
        return self.lone_ttl_s if self.lone else self.ttl_s

    def wake(self) -> None:
        """Run a tick now rather than at the end of the current pause (a cell
        was released: the member it is assigned to takes it at once).
        Coalesced: any number of wakes before the tick starts make one
        tick; a wake during a tick makes one more right after it (that
        tick may have read the leases before the release). Safe to call
        before ``start`` or after ``stop`` (nothing happens then)."""
        self._wake.set()

    def set_cells(self, cells: Iterable[str]) -> None:
        """The cells to coordinate from the next tick (a cell dropped is released)."""
        self._cells = sorted(set(cells))

    def cells(self) -> list[str]:
        """The cells coordinated now (sorted)."""
        return list(self._cells)

    def drop_cells(self, cells: Iterable[str]) -> None:
        """Stop coordinating ``cells`` from the next tick, which releases
        those held (why ``removed``); an idle cell (serving.release_idle)."""
        gone = set(cells)
        self._cells = [c for c in self._cells if c not in gone]

    def add_cells(self, cells: Iterable[str]) -> bool:
        """Coordinate these cells too, from the next tick (a pool seen in a
        request, a lease row found in the table); True when any was new."""
        new = set(cells).difference(self._cells)
        if new:
            self._cells = sorted(new.union(self._cells))
        return bool(new)

    async def claim(self, cell: str, members: Iterable[str] | None = None) -> int | None:
        """Take ``cell`` now rather than at the next tick, when it is assigned
        to this member over ``members`` (default: the live members of the last
        tick); the epoch when it is ours afterwards, else None. The database
        decides as in a tick: a cell another member holds stays its own."""
        self.add_cells([cell])
        epoch = self.owns(cell)
        if epoch is not None:
            return epoch
        live = sorted(set(self.members if members is None else members))
        if self._draining or self.member_id not in live:
            return None
        if assignment([cell], live)[cell] != self.member_id:
            return None
        async with self._tick_lock:  # never beside a tick's own acquire or release
            if cell not in self._leases and not self._draining:
                await self._acquire(cell)
        return self.owns(cell)

    # --- life cycle ---

    def start(self) -> asyncio.Task[None]:
        if self.task is None:
            self.task = asyncio.create_task(self._run(), name=f"ha-{self.member_id}")
        return self.task

    async def stop(self) -> None:
        """Stop ticking WITHOUT releasing (as a crash would): the leases run
        out on the clock here and in the database. ``drain`` hands off."""
        task, self.task = self.task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def drain(self) -> None:
        """Graceful exit (SIGTERM): stop acquiring, mark the member draining
        (out of every assignment), release every cell at once, leave. The
        new owners take the cells on their next tick, without waiting for
        expiry. Database errors are logged: what is not released expires."""
        self._draining = True
        async with self._tick_lock:  # let a tick in progress finish
            await self.stop()
        held = {cell: lease.epoch for cell, lease in self._leases.items()}
        for cell in list(self._leases):
            self._lose(cell, DRAIN)
        held.update(self._to_release)
        self._to_release.clear()
        for what, fn, args in (
            ("heartbeat", self.store.heartbeat, (self.member_id, self.address, True)),
            ("release", self.store.release_many, (self.member_id, held)),
            ("leave", self.store.leave, (self.member_id,)),
        ):
            try:
                await self._call(fn, *args, what=what)
            except Exception as exc:
                log.warning("ha drain step failed", step=what, error=str(exc))

    async def _run(self) -> None:
        while True:
            started = self._clock()
            self._wake.clear()  # this tick answers every wake so far
            async with self._tick_lock:
                await self.tick()
            await self._pause(max(0.0, self.tick_s - (self._clock() - started)))

    async def _pause(self, seconds: float) -> None:
        """Sleep ``seconds`` with the injected sleep, or until ``wake()``."""
        if self._wake.is_set():
            return
        sleeper = asyncio.ensure_future(self._sleep(seconds))
        waker = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait((sleeper, waker), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (sleeper, waker):
                task.cancel()
            await asyncio.gather(sleeper, waker, return_exceptions=True)

    # --- one tick ---

    async def tick(self) -> None:
        if self._draining:
            return
        me = self.member_id
        beat = await self._try("heartbeat", self.store.heartbeat, me, self.address, False)
        for cell in list(self._leases):
            await self._renew(cell)
        for cell, epoch in list(self._to_release.items()):
            del self._to_release[cell]
            await self._try("release", self.store.release, cell, me, epoch)
        members = await self._try("live members", self.store.live_members, self.ttl_s)
        if not beat or members is None or me not in members or self._draining:
            return  # cannot tell the assignment: keep what we hold, take nothing
        self.members = members
        assigned = assignment(self._cells, members)
        for cell in list(self._leases):
            owner = assigned.get(cell)
            if owner != me:
                lease = self._leases.get(cell)
                if lease is None:
                    continue
                self._lose(cell, REMOVED if owner is None else HANDOFF)
                await self._try("release", self.store.release, cell, me, lease.epoch)
        for cell, owner in assigned.items():
            if owner == me and cell not in self._leases and not self._draining:
                await self._acquire(cell)

    async def _renew(self, cell: str) -> None:
        lease = self._leases.get(cell)
        if lease is None or self.owns(cell) is None:
            return
        ttl, t_sent = self.lease_ttl(), self._clock()
        # Whatever becomes of this renew, the database's lease may end at
        # t_sent + ttl from now on (a lone member's longer lease shortened
        # when it stops being lone): never trust it longer than that.
        if t_sent + ttl - self.margin_s < lease.deadline:
            lease.deadline = t_sent + ttl - self.margin_s
            self._trace("renew", cell, lease.epoch, deadline_ns=lease.deadline)
        try:
            ok = await self._call(
                self.store.renew, cell, self.member_id, lease.epoch, ttl, what="renew"
            )
        except Exception as exc:  # keep the lease until its deadline; retry next tick
            log.warning("ha renew failed", cell=cell, error=str(exc))
            return
        if self._leases.get(cell) is not lease:  # lost while we waited
            if ok:
                self._to_release[cell] = lease.epoch
            return
        if not ok:
            self._lose(cell, REFUSED)
        elif self.owns(cell) is not None:  # still valid now: extend from t_sent
            deadline = t_sent + ttl - self.margin_s
            self._trace("renew", cell, lease.epoch, deadline_ns=deadline)  # before it is used
            lease.deadline = deadline

    async def _acquire(self, cell: str) -> None:
        ttl, t_sent = self.lease_ttl(), self._clock()
        try:
            epoch = await self._call(self.store.acquire, cell, self.member_id, ttl, what="acquire")
        except Exception as exc:  # unknown outcome: a later acquire re-takes it
            log.warning("ha acquire failed", cell=cell, error=str(exc))
            return
        if epoch is None:
            return
        now, deadline = self._clock(), t_sent + ttl - self.margin_s
        if now >= deadline or self._draining or cell in self._leases:
            # Too late to use it (or we are leaving): give it straight back.
            self._trace("unused", cell, epoch, at_ns=now)
            await self._try("release", self.store.release, cell, self.member_id, epoch)
            return
        self._trace("start", cell, epoch, start_ns=now, deadline_ns=deadline)  # before owns()
        self._leases[cell] = Lease(epoch, now, deadline)
        self.counts["acquired"] += 1
        log.info("ha cell acquired", cell=cell, epoch=epoch, member=self.member_id)
        try:
            self._on_acquired(cell, epoch)
        except Exception:
            log.exception("ha on_acquired callback failed", cell=cell)

    def _lose(self, cell: str, why: str) -> None:
        lease = self._leases.pop(cell)
        until = min(self._clock(), lease.deadline)
        self._trace("end", cell, lease.epoch, why, end_ns=until)
        self.history.append(
            Interval(cell, self.member_id, lease.epoch, lease.valid_from, until, why)
        )
        self.counts[why] += 1
        if why == EXPIRED:  # perhaps still ours in the database: free it for the next owner
            self._to_release[cell] = lease.epoch
        log.info("ha cell lost", cell=cell, epoch=lease.epoch, why=why, member=self.member_id)
        try:
            self._on_lost(cell, lease.epoch, why)
        except Exception:
            log.exception("ha on_lost callback failed", cell=cell)

    def _trace(self, ev: str, cell: str, epoch: int, why: str = "", **at: float) -> None:
        """The ownership trace (controlplane/ha/trace.py), when it is on:
        off, one None check per lease event."""
        if (sink := trace.SINK) is not None:
            times = {k: trace.ns(v) for k, v in at.items()}
            sink.write(ev, member=self.member_id, cell=cell, epoch=epoch, **times,
                       **({"why": why} if why else {}))  # fmt: skip

    async def _call(self, fn: Callable[..., Any], *args: Any, what: str) -> Any:
        return await _blocking.call(fn, *args, wait_s=self.call_wait_s, what=what)

    async def _try(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """A call whose failure is logged and answered None (tried next tick)."""
        try:
            result = await self._call(fn, *args, what=what)
        except Exception as exc:
            log.warning("ha database call failed", step=what, error=str(exc))
            return None
        return True if result is None else result

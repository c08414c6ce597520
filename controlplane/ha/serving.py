"""Ownership as ``serve`` uses it (docs/ha.md): which cell a pool is
in, whether this replica owns it now, and if not, where to send the caller.

The owner of a cell is
(a) the holder of a valid lease in the latest snapshot of ``ha_cell_leases``
    (read every ``tick_s``, and again at most every ``MISS_REFRESH_S`` when a
    request meets a cell not owned here), else
(b) the rendezvous (HRW) owner over the live members of that snapshot.
When (b) names this replica and nobody holds the cell, it is claimed on
demand (``Coordinator.claim``, bounded by ``claim_wait_s``) before the
request is decided, so a new pool needs no tick to get an owner.

Only declared pools are routed: ``check_pool`` (the service's declared-pool
check) runs before anything else, so a made-up pool name never claims a
cell nor writes a lease row (docs/operating.md, "Declaring pools").

The cells of the declared pools (``add_pools``) and every cell met in a
request are handed to the coordinator, which acquires and renews them. A
cell with no request routed here for ``idle_release_s`` (and nothing in
flight in its pools) is dropped and its lease released (``release_idle``,
every ``tick_s``): a lease row is not renewed forever for a pool nobody
uses. The next request claims it again on demand. Rows found in the lease
table are not adopted: a dead member's cell is taken over when its traffic
comes to another replica (claimed on demand, as a new pool is).

On SQLite there is no coordinator: one replica (its file lock), every cell
owned, ``epoch_for_pool`` answers ``LOCAL_EPOCH`` ("no fencing").
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from controlplane.aiotime import within
from controlplane.domain.cells import CellMap
from controlplane.domain.rendezvous import owner_of
from controlplane.ha import _blocking
from controlplane.ha.coordinator import DRAIN, EXPIRED, HANDOFF, REFUSED, REMOVED, Coordinator
from controlplane.store.leases import CellOwner

if TYPE_CHECKING:
    from controlplane.ha.shares import TenantShares

log = structlog.get_logger("burstgate.ha")

DEFAULT_POOL = "default"  # as controlplane.service.gate.DEFAULT_POOL (the pool of none)
# (cell, epoch) on a single replica (SQLite): epoch 0 is never a lease's
# epoch (acquire raises it to 1 or more), so it means "no fencing".
LOCAL_EPOCH = 0
# A request for a cell not owned here refreshes the snapshot at most this often.
MISS_REFRESH_S = 0.05
# The hint of a redirect whose owner is not known yet (RetryInfo).
UNKNOWN_OWNER_RETRY_S = 0.1
# A cell with no request routed here for this long is released (the server
# sets BURSTGATE_HA_CELL_IDLE_S, never below the reservation TTL, so every
# reservation admitted in the cell has ended by then).
IDLE_RELEASE_S = 900.0



@dataclass(frozen=True, slots=True)
class Redirect:
    """A cell owned elsewhere: its owner (member id, advertise address; ""
    while unknown) and the lease epoch (0: no lease seen)."""

    pool: str
    cell: str
    owner: str
    address: str
    epoch: int

    @property
    def retry_s(self) -> float:
        return 0.0 if self.address else UNKNOWN_OWNER_RETRY_S


@dataclass(frozen=True, slots=True)
class CellView:
    """One cell as GetCellOwners reports it."""

    cell: str
    pools: tuple[str, ...]
    owner: str
    address: str
    epoch: int
    lease_left_s: float


class Ownership:
    """``coordinator`` None: a single replica (SQLite) that owns every cell."""

    def __init__(
        self,
        coordinator: Coordinator | None,
        cellmap: CellMap | None = None,
        *,
        claim_wait_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.coordinator = coordinator
        self.cellmap = cellmap or CellMap()
        self.claim_wait_s = claim_wait_s
        self._clock = clock
        self._owners: dict[str, CellOwner] = {}
        self._owners_at = float("-inf")  # clock when the snapshot was read
        self._members: dict[str, str] = {}  # live member -> address, at the snapshot
        self._seen_pools: set[str] = set()
        self._refreshing: asyncio.Task[None] | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._draining = False
        self.redirects_total = 0
        # Cells just acquired whose state is being rebuilt from the database
        # (the server's takeover task): their requests wait for it, at most
        # claim_wait_s, so nothing is decided before the old owner's usage
        # of the hour is counted.
        self.rebuilding: dict[str, asyncio.Future[None]] = {}
        # This replica's shares of its tenants' limits (ha/shares.py), on
        # PostgreSQL; stopped with the cells (released on a drain).
        self.shares: TenantShares | None = None
        # The service's declared-pool check (InvalidArgument naming `pool`),
        # run before a pool is routed: an undeclared pool claims no cell.
        self.check_pool: Callable[[str], None] | None = None
        # Idle release: cell -> clock of the last request routed here;
        # ``in_use(pools)``: whether anything still runs in them (the gate's
        # in-flight count), which keeps an idle cell held.
        self.idle_release_s = IDLE_RELEASE_S
        self.in_use: Callable[[tuple[str, ...]], bool] | None = None
        self._used: dict[str, float] = {}
        self.idle_released_total = 0

    # --- the hot path ---

    @property
    def local(self) -> bool:
        return self.coordinator is None

    def cell_of(self, pool: str) -> str:
        """ValueError for a pool whose default cell is an explicit cell's id."""
        return self.cellmap.cell_of(pool or DEFAULT_POOL)

    def epoch_for_pool(self, pool: str) -> tuple[str, int] | None:
        """(cell, epoch) while this replica owns ``pool``'s cell, else None;
        on a single replica (cell, ``LOCAL_EPOCH``)."""
        cell = self.cell_of(pool)
        if self.coordinator is None:
            return cell, LOCAL_EPOCH
        epoch = self.coordinator.owns(cell)
        return None if epoch is None else (cell, epoch)

    def owned_now(self, pool: str) -> bool:
        """Cheap check (a dict lookup and a clock read): owned here now."""
        return self.coordinator is None or self.coordinator.owns(self.cell_of(pool)) is not None

    async def route(self, pool: str) -> Redirect | None:
        """None when this replica decides for ``pool`` (claiming its cell if
        it is ours by HRW and free); else where the caller should go."""
        coord = self.coordinator
        if coord is None:
            return None
        if self.check_pool is not None:
            self.check_pool(pool)  # an undeclared pool: refused before any claim
        cell = self.cell_of(pool)
        self._used[cell] = self._clock()
        if coord.owns(cell) is not None:
            if self.rebuilding:
                await self._rebuilt(cell)
            return None
        self._seen_pools.add(pool)
        coord.add_cells([cell])  # (again after an idle release)
        if self._clock() - self._owners_at > MISS_REFRESH_S:
            with contextlib.suppress(Exception):  # logged by refresh; decide on what we know
                await self.refresh()
            if coord.owns(cell) is not None:
                await self._rebuilt(cell)
                return None
        where = self.redirect_for(pool, cell)
        if where.owner == coord.member_id:
            with contextlib.suppress(TimeoutError):
                epoch = await within(
                    asyncio.shield(coord.claim(cell, self._members)), self.claim_wait_s
                )
                if epoch is not None:
                    await self._rebuilt(cell)
                    return None
            where = Redirect(pool, cell, "", "", where.epoch)
        self.redirects_total += 1
        return where

    def leased_owner(self, pool: str) -> Redirect | None:
        """The other member whose lease on ``pool``'s cell the last snapshot
        holds (unexpired, with an address), read from memory only; None when
        the snapshot names none, or the cell is owned here. For a caller
        that sees a stale answer itself and then asks :meth:`route` (the
        Envoy forward: the member it reaches answers "not the owner"), so a
        steady stream of calls for a foreign cell reads no table."""
        coord = self.coordinator
        if coord is None:
            return None
        cell = self.cell_of(pool)
        lease = self._owners.get(cell)
        if lease is None or not lease.owner or lease.expired or lease.owner == coord.member_id:
            return None
        address = lease.address or self._members.get(lease.owner, "")
        if not address or _seconds_left(lease) <= 0 or coord.owns(cell) is not None:
            return None
        return Redirect(pool, cell, lease.owner, address, lease.epoch)

    async def _rebuilt(self, cell: str) -> None:
        """Wait (bounded) for ``cell``'s takeover rebuild, if one is running."""
        task = self.rebuilding.get(cell)
        if task is not None and not task.done():
            with contextlib.suppress(Exception):  # a timeout, or a failed rebuild
                await within(asyncio.shield(task), self.claim_wait_s)

    def redirect_for(self, pool: str, cell: str) -> Redirect:
        """The owner of a cell not owned here, from the snapshot (the lease
        holder, else HRW over the live members); this member's own id when
        it is the HRW owner of a free cell (the caller claims it)."""
        coord = self.coordinator
        me = coord.member_id if coord is not None else ""
        lease = self._owners.get(cell)
        epoch = lease.epoch if lease is not None else 0
        if lease is not None and lease.owner and not lease.expired and lease.owner != me:
            address = lease.address or self._members.get(lease.owner, "")
            return Redirect(pool, cell, lease.owner, address, epoch)
        live = [m for m in self._members if not (self._draining and m == me)]
        if not live:
            return Redirect(pool, cell, "", "", epoch)
        owner = owner_of(cell, live)
        address = "" if owner == me else self._members.get(owner, "")
        return Redirect(pool, cell, owner, address, epoch)

    # --- the snapshot ---

    async def refresh(self) -> None:
        """Read the lease table and the live members (one refresh in flight,
        shared by everyone who asks meanwhile)."""
        task = self._refreshing
        if task is None or task.done():
            task = self._refreshing = asyncio.ensure_future(self._refresh())
        await asyncio.shield(task)

    async def _refresh(self) -> None:
        coord = self.coordinator
        assert coord is not None
        started = self._clock()
        store, ttl = coord.store, coord.ttl_s

        def read() -> tuple[dict[str, CellOwner], dict[str, str]]:
            return store.owners(), store.live_addresses(ttl)

        owners, members = await _blocking.call(read, wait_s=coord.call_wait_s, what="ha owners")
        self._owners, self._members, self._owners_at = owners, members, started

    def add_pools(self, pools: Iterable[str]) -> None:
        """Pools the config declares: their cells are coordinated from now
        (and released after ``idle_release_s`` without a request)."""
        if self.coordinator is not None:
            cells = self.cellmap.cells(set(pools) | {DEFAULT_POOL})
            now = self._clock()
            for cell in cells:
                self._used.setdefault(cell, now)
            self.coordinator.add_cells(cells)

    def release_idle(self) -> list[str]:
        """Stop coordinating the cells with no request routed here for
        ``idle_release_s`` and nothing in flight in their pools; the
        coordinator releases those it holds on its next tick (woken now).
        Returns the cells dropped."""
        coord = self.coordinator
        if coord is None:
            return []
        now = self._clock()
        for cell in coord.cells():
            self._used.setdefault(cell, now)  # a cell the coordinator met first
        idle = [
            cell for cell, at in self._used.items()
            if now - at >= self.idle_release_s
            and not (self.in_use is not None and self.in_use(self._pools_of(cell)))
        ]  # fmt: skip
        if not idle:
            return []
        for cell in idle:
            del self._used[cell]
        self._seen_pools = {p for p in self._seen_pools if self.cell_of(p) not in idle}
        coord.drop_cells(idle)
        coord.wake()
        self.idle_released_total += len(idle)
        log.info("ha idle cells released", cells=sorted(idle)[:20], count=len(idle),
                 idle_s=self.idle_release_s)  # fmt: skip
        return idle

    # --- life cycle ---

    async def start(self) -> None:
        """Read the table, then run the coordinator's first tick, so the cells
        assigned to this replica are owned before it reports SERVING."""
        coord = self.coordinator
        if coord is None:
            return
        with contextlib.suppress(Exception):
            await self.refresh()
        await coord.tick()
        with contextlib.suppress(Exception):
            await self.refresh()
        coord.start()
        self._loop_task = asyncio.create_task(self._refresh_loop(), name="ha-owners")

    async def _refresh_loop(self) -> None:
        coord = self.coordinator
        assert coord is not None
        while True:
            await asyncio.sleep(coord.tick_s)
            try:
                await self.refresh()
            except Exception as exc:
                log.warning("ha owners snapshot failed; serving the last one", error=str(exc))
            try:
                self.release_idle()
            except Exception:
                log.exception("ha idle release failed")

    async def _stop_loop(self) -> None:
        task, self._loop_task = self._loop_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def drain(self) -> None:
        """SIGTERM: release every cell at once (another replica takes them on
        its next tick, or at once when a client is redirected to it), then
        answer redirects from a fresh snapshot without this member."""
        coord = self.coordinator
        if coord is None or self._draining:
            return
        self._draining = True
        await self._stop_loop()
        await coord.drain()
        if self.shares is not None:  # no cell here now: the shares go too
            await self.shares.stop(release=True)
        with contextlib.suppress(Exception):
            await self.refresh()

    async def crash(self) -> None:
        """Stop without releasing anything (tests: as kill -9 would): the
        leases run out on the clock."""
        self._draining = True  # a later drain() (the server's stop) releases nothing
        await self._stop_loop()
        if self.shares is not None:  # its shares run out on the clock too
            await self.shares.stop(release=False)
        if self.coordinator is not None:
            await self.coordinator.stop()

    # --- owner discovery ---

    def cells_view(self, pool: str = "") -> tuple[list[CellView], dict[str, str]]:
        """Every known cell (or ``pool``'s) with its owner, and the live members."""
        coord = self.coordinator
        if coord is None:
            cells = self.cellmap.cells([pool] if pool else [DEFAULT_POOL])
            if pool:
                cells = [self.cell_of(pool)]
            return [CellView(c, self.cellmap.pools_of(c), "", "", LOCAL_EPOCH, 0.0)
                    for c in cells], {}  # fmt: skip
        names: set[str] = set(self._owners) | set(coord.leases())
        names.update(self.cellmap.cells(()))
        if pool:
            names = {self.cell_of(pool)}
        now = self._clock()
        views = []
        for cell in sorted(names):
            lease = coord.leases().get(cell)
            if lease is not None and coord.owns(cell) is not None:
                views.append(
                    CellView(cell, self._pools_of(cell), coord.member_id, coord.address,
                             lease.epoch, max(0.0, lease.deadline - now))
                )  # fmt: skip
                continue
            r = self.redirect_for(pool or cell, cell)
            snap = self._owners.get(cell)
            left = 0.0
            if snap is not None and snap.owner == r.owner and not snap.expired:
                age = now - self._owners_at
                left = max(0.0, _seconds_left(snap) - age)
            owner = r.owner if (left > 0 or r.owner != coord.member_id) else ""
            views.append(CellView(cell, self._pools_of(cell), owner, r.address, r.epoch, left))
        return views, dict(self._members)

    def pools_of(self, cell: str) -> tuple[str, ...]:
        """The pools of ``cell``: an explicit cell's, or a default cell's own."""
        return self.cellmap.pools_of(cell)

    def _pools_of(self, cell: str) -> tuple[str, ...]:
        explicit = self.cellmap.pools_of(cell)
        seen = tuple(sorted(p for p in self._seen_pools if self.cell_of(p) == cell))
        return tuple(sorted(set(explicit) | set(seen)))

    def collector(self) -> Collector:
        return _OwnershipCollector(self)


def _seconds_left(owner: CellOwner) -> float:
    """Seconds of the lease left when the snapshot was read (database time)."""
    if owner.expires_at is None:
        return 0.0
    from datetime import datetime

    now = datetime.now(owner.expires_at.tzinfo)
    return max(0.0, (owner.expires_at - now).total_seconds())


class _OwnershipCollector(Collector):
    def __init__(self, ownership: Ownership) -> None:
        self._o = ownership

    def collect(self) -> Iterator[Metric]:
        coord = self._o.coordinator
        owned = GaugeMetricFamily(
            "burstgate_ha_cells_owned", "Cells this replica owns now (valid lease)"
        )
        owned.add_metric([], len(coord.owned()) if coord is not None else 1)
        yield owned
        lost = CounterMetricFamily(
            "burstgate_ha_leases_lost",
            "Cell leases this replica lost or gave up, by why "
            "(expired: self-fenced; refused; handoff; removed; drain)",
            labels=["why"],
        )
        counts: Any = coord.counts if coord is not None else {}
        for why in (EXPIRED, REFUSED, HANDOFF, REMOVED, DRAIN):
            lost.add_metric([why], counts.get(why, 0))
        yield lost
        yield CounterMetricFamily(
            "burstgate_ha_cells_idle_released",
            "Cells this replica stopped coordinating (lease released) after no "
            "request for BURSTGATE_HA_CELL_IDLE_S",
            value=self._o.idle_released_total,
        )
        yield CounterMetricFamily(
            "burstgate_ha_redirects",
            "Admission calls (and stream entries) answered NOT_OWNER by this replica",
            value=self._o.redirects_total,
        )
        members = GaugeMetricFamily(
            "burstgate_ha_members_live", "Live replicas on this database (last snapshot)"
        )
        members.add_metric([], len(self._o._members) if coord is not None else 1)
        yield members
        if self._o.shares is not None:
            from controlplane.ha.shares import SharesCollector

            yield from SharesCollector(self._o.shares).collect()

"""Scale-out wiring of one ``ControlPlane`` (docs/ha.md): the cell
coordinator joined at start, the pricing windows' fence, the takeover
rebuild when a cell is acquired, and the wake-up when another replica
releases a cell. Kept out of app.py, which composes it; nothing here
runs per request (``Ownership.route`` in controlplane/ha/serving.py does).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import structlog
from sqlalchemy import Engine

from controlplane.aiotime import within
from controlplane.domain.errors import DomainError
from controlplane.ha import trace
from controlplane.ha.coordinator import Coordinator
from controlplane.ha.serving import Ownership
from controlplane.ha.shares import TenantShares
from controlplane.ledger.fencing import UNFENCED
from controlplane.settings import Settings
from controlplane.store.leases import HaStore
from controlplane.store.shares import ShareStore

if TYPE_CHECKING:
    from controlplane.ledger.metering import Metering
    from controlplane.service import AdmissionService

log = structlog.get_logger("burstgate.server")

TAKEOVER_ATTEMPTS = 3
# The pool gate's takeover hold (docs/ha.md, "The gate during a takeover"):
# at most this long, and at most a third of the lease TTL (the claim wait).
REANNOUNCE_WINDOW_MAX_S = 1.0


class ReplicaWiring:
    """``metering`` is set by the server once it exists (None: no ledger);
    ``service``: the admission service whose pool gate holds a cell taken
    over (None: no hold)."""

    def __init__(
        self, settings: Settings, ownership: Ownership, service: AdmissionService | None = None
    ) -> None:
        self.settings = settings
        self.ownership = ownership
        self.service = service
        self.metering: Metering | None = None
        self._tasks: set[asyncio.Future[None]] = set()
        self._epochs: dict[str, int] = {}  # cell -> the epoch this replica last held
        self.holds_total = 0

    @property
    def reannounce_window_s(self) -> float:
        """How long a taken-over cell's pools are held at most."""
        return min(REANNOUNCE_WINDOW_MAX_S, self.settings.ha_lease_ttl_s / 3)

    def share_interval_s(self) -> float:
        """How often tenant shares are renewed (controlplane/ha/shares.py)."""
        return min(1.0, self.settings.ha_lease_ttl_s / 5)

    def share_limits(self, engine: Engine) -> None:
        """On PostgreSQL, before anything is decided or restored: tenants are
        limited to this replica's share of their limits (none until the
        first refresh), since other replicas may decide for them too."""
        if engine.dialect.name == "postgresql" and self.service is not None:
            self.service.shares.start(int(self.share_interval_s() * 1e9))

    async def start(self, engine: Engine, port: int, config_pools: Iterable[str]) -> None:
        """On PostgreSQL: join the members and take this replica's cells
        before SERVING; on SQLite nothing (one replica owns every cell)."""
        if engine.dialect.name != "postgresql":
            return
        s = self.settings
        address, member = s.advertised(port), s.member_id()
        if s.ha_trace_file is not None:  # off by default (a test/diagnostic aid)
            trace.configure(s.ha_trace_file, member)
        coordinator = Coordinator(
            HaStore(engine), member, address, self.ownership.cellmap.cells(()),
            ttl_s=s.ha_lease_ttl_s, margin_s=s.ha_margin_s, lone_ttl_s=s.ha_lone_lease_ttl_s,
            on_acquired=self.cell_acquired, on_lost=self.cell_lost,
        )  # fmt: skip
        self.ownership.coordinator = coordinator
        self.ownership.claim_wait_s = min(1.0, s.ha_lease_ttl_s / 3)
        self.ownership.idle_release_s = s.ha_cell_idle_release_s
        if self.service is not None:
            svc = self.service
            # only declared pools are routed (a made-up name claims no cell),
            # and a cell with requests in flight is not idle
            self.ownership.check_pool = svc.replicas.check_pool
            self.ownership.in_use = lambda pools: any(svc.views.gate_inflight(p) for p in pools)
        self.ownership.add_pools(config_pools)
        await self.ownership.start()
        if self.service is not None:
            shares = TenantShares(
                self.service, ShareStore(engine), coordinator.member_id, s.ha_lease_ttl_s,
                s.ha_margin_s, interval_s=self.share_interval_s(), affine=self._home_here,
                ttl_for=coordinator.lease_ttl,
            )  # fmt: skip
            await shares.start()
            self.ownership.shares = shares
        log.info("ha member joined", member=coordinator.member_id, address=address,
                 cells_owned=sorted(coordinator.owned()))  # fmt: skip

    def _home_here(self, tenant_id: str) -> bool:
        """This replica owns the cell of the tenant's configured pool."""
        assert self.service is not None
        try:
            return self.ownership.owned_now(self.service.shares.home_pool(tenant_id))
        except (ValueError, DomainError):  # a pool naming a cell; a tenant just removed
            return False

    def lease_released(self, cell: str | None) -> None:
        """A cell was released (or the notify listener reconnected): tick the
        coordinator now, so the member the cell is assigned to takes it
        without waiting for its next tick."""
        coordinator = self.ownership.coordinator
        if coordinator is not None:
            coordinator.wake()

    def fencing(self, pool: str) -> Any:
        """The pricing windows' fence (controlplane/ledger/fencing.py): the
        lease of ``pool``'s cell while owned here, None when not; a single
        replica (SQLite) writes unfenced."""
        return UNFENCED if self.ownership.local else self.ownership.epoch_for_pool(pool)

    def cell_acquired(self, cell: str, epoch: int) -> None:
        """The coordinator took ``cell``. Taken from another replica, its
        pools' gate is held (``hold_over``). Then continue its pools'
        pricing windows and count the quota usage the ledger holds for them
        (takeover.py). Runs as a task (the callback is synchronous); until
        it has run, the pools' window rows are not written, and requests for
        the cell wait for it (``Ownership.rebuilding``, at most the claim wait)."""
        pools = self.ownership.pools_of(cell)
        self.hold_over(cell, epoch, pools)
        if self.metering is None:
            return
        task = asyncio.ensure_future(self._take_over(cell, epoch, pools))
        self._tasks.add(task)
        self.ownership.rebuilding[cell] = task

        def done(t: asyncio.Future[None]) -> None:
            self._tasks.discard(t)
            if self.ownership.rebuilding.get(cell) is t:
                del self.ownership.rebuilding[cell]

        task.add_done_callback(done)

    def hold_over(self, cell: str, epoch: int, pools: tuple[str, ...]) -> None:
        """A cell another replica may have held since this one last did (a
        new epoch that is not the next of our own): its requests may still
        run on the engines, known to the gate here only through the next
        load reports or the reservations sidecars re-announce. Release
        nothing to its pools until either, at most ``reannounce_window_s``.
        A brand-new cell (epoch 1) or our own next epoch holds nothing."""
        last = self._epochs.get(cell)
        self._epochs[cell] = epoch
        if epoch <= 1 or last == epoch - 1 or self.service is None:
            return
        self.service.replicas.hold_pools(pools, self.reannounce_window_s)
        self.holds_total += 1
        log.info("ha cell taken over: gate held", cell=cell, epoch=epoch,
                 hold_s=self.reannounce_window_s)  # fmt: skip

    async def _take_over(self, cell: str, epoch: int, pools: tuple[str, ...]) -> None:
        metering = self.metering
        assert metering is not None
        for attempt in range(TAKEOVER_ATTEMPTS):
            if self.ownership.epoch_for_pool(pools[0]) != (cell, epoch):
                return  # lost again meanwhile
            try:
                await metering.take_over(pools)
                return
            except Exception as exc:  # database down: its windows stay unwritten
                log.warning("ha takeover rebuild failed", cell=cell, attempt=attempt + 1,
                            error=str(exc))  # fmt: skip
                await asyncio.sleep(0.5 * (attempt + 1))

    def cell_lost(self, cell: str, epoch: int, why: str) -> None:
        pools = self.ownership.pools_of(cell)
        if self.metering is not None:
            self.metering.release_pools(pools)
        if self.service is not None:  # the new owner's gate counts what runs there
            self.service.replicas.forget_pools(pools)

    async def stop(self) -> None:
        """Cancel takeover rebuilds still running (the server is stopping:
        the database may be gone next)."""
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def flush_before_drain(self) -> None:
        """The windows measured so far, written under the leases still held
        (after the drain they could not be: the cells are someone else's)."""
        if self.metering is not None and not self.ownership.local:
            try:
                await within(self.metering.flush_windows(), 2.0)
            except Exception as exc:
                log.warning("pricing windows not flushed before the handoff", error=str(exc))

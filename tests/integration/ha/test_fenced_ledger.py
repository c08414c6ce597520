"""Two replicas' metering on one PostgreSQL with real leases (HaStore): the
owner's pricing-window writes land, an ex-owner's are refused and counted
(none lands), a stale writer's transaction in flight orders before the
takeover, and the new owner continues the windows (same multiplier) and the
tenants' hourly quota usage from the database.

Each replica is the real ``AdmissionService`` + ``PricingBook`` +
``Metering`` on its own engine; its ``fencing`` is a plain function over the
leases the test acquired, the shape of ``ControlPlane.epoch_for_pool``.
Background loops are not started: every flush is driven by the test."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from decimal import Decimal
from pathlib import Path

import pytest
from sqlalchemy import Engine, text

from controlplane.domain import Decision, LaneConfig, TenantConfig
from controlplane.domain.policy import Policy
from controlplane.domain.pricing import StepTable
from controlplane.ledger.fencing import FenceToken
from controlplane.ledger.metering import Metering
from controlplane.ledger.pricing import PricingBook
from controlplane.service import AdmissionService, ServiceLimits
from controlplane.settings import Settings
from controlplane.store.leases import HaStore
from controlplane.telemetry.ledger_metrics import LedgerCollector
from fastpath import Reason
from tests.conftest import FakeClock

pytestmark = pytest.mark.postgres

POOL = "pool-a"
S = 1_000_000_000
W = 300 * S  # pricing window
LANES = [LaneConfig("standard", 0, Decimal("1"), 800, False, True)]
ACME = TenantConfig(
    tenant_id="acme", token_rate=Decimal(10**6), burst_tokens=10**6, hourly_quota=10_000
)


class Replica:
    """One replica's metering, fenced by the leases in ``self.leases``."""

    def __init__(self, name: str, url: str, clock: FakeClock, spool: Path) -> None:
        self.name = name
        self.leases: dict[str, FenceToken] = {}
        settings = Settings(
            database_url=url,
            ledger_spool_dir=spool / name,
            pricing_steps=[(Decimal("0.30"), Decimal("1.20")), (Decimal("0.60"), Decimal("1.50"))],
            policy=Policy(known_pools=[POOL]),  # declared (docs/operating.md)
        )
        book = PricingBook(settings.pricing_window_s, StepTable(settings.pricing_steps))
        self.svc = AdmissionService(ServiceLimits.of(settings), clock=clock, pricing=book)
        self.svc.apply_config([ACME], LANES)
        self.m = Metering(self.svc, settings, book, fencing=self.leases.get)

    async def start(self) -> None:
        await self.m.writer.start()

    async def stop(self) -> None:
        await self.m.writer.stop()
        self.m.engine.dispose()

    def stale(self) -> float:
        fams = {f.name: f for f in LedgerCollector(self.m).collect()}
        (sample,) = fams["burstgate_ha_stale_writes"].samples
        assert sample.labels == {"table": "pricing_windows"}
        return sample.value

    async def serve(self, request_id: str, prompt: int, output: int) -> Reason:
        d = self.svc.admit("acme", request_id, "", prompt, output, "m", POOL)
        if d.decision == Decision.ADMIT:
            await self.m.complete(
                "acme", request_id, d.reservation_id, prompt, output, 0, 0.9
            )  # a 0.9 miss rate: the next window's multiplier is 1.5
        return d.reason


def stored(engine: Engine) -> list[tuple[int, int, Decimal, bool]]:
    """(window start, completions, multiplier, closed) of the pool's rows."""
    q = text(
        "SELECT window_start, completions, multiplier, closed FROM pricing_windows"
        " WHERE pool = :p ORDER BY window_start"
    )
    with engine.connect() as c:
        return [tuple(r) for r in c.execute(q, {"p": POOL})]


def acquire(store: HaStore, r: Replica, cell: str = POOL) -> int:
    epoch = store.acquire(cell, r.name, 30)
    assert epoch is not None
    r.leases[cell] = (cell, epoch)
    return epoch


async def poll(predicate: Callable[[], bool], what: str) -> None:
    for _ in range(800):
        if predicate():
            return
        await asyncio.sleep(0.025)
    raise AssertionError(f"timed out waiting for {what}")


def run(
    ha_url: str, tmp_path: Path, body: Callable[[Replica, Replica, FakeClock], Awaitable[None]]
) -> None:
    clock = FakeClock(5_666_667 * W + 10 * S)  # 10 s into a window, mid-hour

    async def main() -> None:
        a = Replica("a", ha_url, clock, tmp_path)
        b = Replica("b", ha_url, clock, tmp_path)
        await a.start()
        await b.start()
        try:
            await body(a, b, clock)
        finally:
            await a.stop()
            await b.stop()

    asyncio.run(main())


def test_stale_owner_refused_new_owner_continues_windows(
    ha_url: str, store: HaStore, engine: Engine, tmp_path: Path
) -> None:
    async def body(a: Replica, b: Replica, clock: FakeClock) -> None:
        assert acquire(store, a) == 1
        await a.m.take_over([POOL])
        assert await a.serve("r1", 1000, 100) == Reason.OK
        await a.m.flush_windows()
        k = clock() // S // 300 * 300
        assert stored(engine) == [(k, 1, Decimal("1.000000"), False)]
        clock.advance(W)  # window k+1: its price comes from k's 0.9
        assert a.svc.admit("acme", "r2", "", 10, 10, "m", POOL).pricing_multiplier == 1.5
        await a.m.flush_windows()
        before = [(k, 1, Decimal("1.000000"), True), (k + 300, 0, Decimal("1.500000"), False)]
        assert stored(engine) == before

        # b takes the cell over (a's lease handed off); a still believes in epoch 1
        assert store.release(POOL, "a", 1)
        assert acquire(store, b) == 2
        assert await a.serve("r3", 1000, 100) == Reason.OK  # a measures more...
        await a.m.flush_windows()  # ...and is refused by the fence
        assert stored(engine) == before
        assert a.stale() == 1  # the open (pool-a, m) row of window k+1
        assert a.m.pricing.in_force() == []  # a dropped the pool's windows
        # a's later rows (its live quotes) are never written, nor counted again
        a.svc.admit("acme", "r4", "", 10, 10, "m", POOL)
        await a.m.flush_windows()
        assert stored(engine) == before and a.stale() == 1

        rebuilt = await b.m.take_over([POOL])
        assert rebuilt.windows == 2
        assert b.svc.admit("acme", "r5", "", 10, 10, "m", POOL).pricing_multiplier == 1.5  # not 1.0
        assert await b.serve("r6", 1000, 100) == Reason.OK
        await b.m.flush_windows()
        assert stored(engine)[-1] == (k + 300, 1, Decimal("1.500000"), False)
        assert b.stale() == 0

        # a gets the cell back: a new epoch, and a rebuild from b's rows
        assert store.release(POOL, "b", 2)
        assert acquire(store, a) == 3
        await a.m.take_over([POOL])
        assert await a.serve("r7", 1000, 100) == Reason.OK
        await a.m.flush_windows()
        assert stored(engine)[-1] == (k + 300, 2, Decimal("1.500000"), False)
        # b's lease is gone locally too (on_lost): nothing written, nothing counted
        del b.leases[POOL]
        b.m.release_pools([POOL])
        await b.m.flush_windows()
        assert b.stale() == 0 and stored(engine)[-1][1] == 2
        # a's lease gone locally without on_lost (fencing answers None): its
        # rows are not written, and counted
        del a.leases[POOL]
        assert await a.serve("r8", 1000, 100) == Reason.OK
        await a.m.flush_windows()
        assert a.stale() == 2 and stored(engine)[-1][1] == 2

    run(ha_url, tmp_path, body)


def test_stale_write_in_flight_lands_before_the_takeover(
    ha_url: str, store: HaStore, engine: Engine, tmp_path: Path
) -> None:
    async def body(a: Replica, b: Replica, clock: FakeClock) -> None:
        assert store.acquire(POOL, "a", 0.2) == 1  # a short lease, left to expire
        a.leases[POOL] = (POOL, 1)
        await a.m.take_over([POOL])
        assert await a.serve("r1", 1000, 100) == Reason.OK
        await a.m.flush_windows()
        assert await a.serve("r2", 1000, 100) == Reason.OK
        with engine.connect() as blocker:
            # hold the window row, so that a's next write stops inside its
            # fenced transaction (after the fence, at the upsert)
            tx = blocker.begin()
            blocker.execute(text("SELECT 1 FROM pricing_windows FOR UPDATE"))
            flushing = asyncio.ensure_future(a.m.flush_windows())
            await poll(lambda: waiting_on_lock(engine, "INSERT INTO pricing_windows"), "a's upsert")
            await poll(lambda: store.owners()[POOL].expired, "a's lease to expire")
            taking = asyncio.ensure_future(asyncio.to_thread(store.acquire, POOL, "b", 30))
            await poll(lambda: waiting_on_lock(engine, "UPDATE ha_cell_leases"), "b's acquire")
            assert not taking.done()  # the takeover waits for a's fenced transaction
            tx.commit()
        await flushing
        assert await taking == 2
        assert stored(engine)[0][1] == 2  # a's write landed, before the takeover
        b.leases[POOL] = (POOL, 2)
        assert await a.serve("r3", 1000, 100) == Reason.OK
        await a.m.flush_windows()  # after it: refused
        assert a.stale() == 1 and stored(engine)[0][1] == 2
        await b.m.take_over([POOL])
        assert await b.serve("r4", 1000, 100) == Reason.OK
        await b.m.flush_windows()
        assert stored(engine)[0][1] == 3  # b continued a's count: 2 + 1

    run(ha_url, tmp_path, body)


def waiting_on_lock(engine: Engine, query_start: str) -> bool:
    q = text(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
        " AND datname = current_database() AND query LIKE :q"
    )
    with engine.connect() as c:
        return bool(c.execute(q, {"q": query_start + "%"}).scalar_one())


def test_hourly_quota_usage_carries_over_a_takeover(
    ha_url: str, store: HaStore, tmp_path: Path
) -> None:
    async def body(a: Replica, b: Replica, clock: FakeClock) -> None:
        assert acquire(store, a) == 1
        await a.m.take_over([POOL])
        for i in range(3):  # 9,000 of acme's 10,000 hourly tokens, settled by a
            assert await a.serve(f"a{i}", 2000, 1000) == Reason.OK
        assert b.svc.views.tenant_limits("acme").hourly_remaining == 10_000  # b knows nothing yet

        assert store.release(POOL, "a", 1)
        assert acquire(store, b) == 2
        rebuilt = await b.m.take_over([POOL])
        assert (rebuilt.tenants, rebuilt.hour_tokens) == (1, 9000)
        assert await b.serve("b0", 2000, 1000) == Reason.HOURLY_QUOTA  # would overshoot
        assert b.svc.views.tenant_limits("acme").hourly_remaining == 1000
        again = await b.m.take_over([POOL])  # idempotent: nothing new in the ledger
        assert (again.tenants, again.hour_tokens) == (0, 0)
        assert await b.serve("b1", 500, 500) == Reason.OK  # the last 1,000
        assert b.svc.views.tenant_limits("acme").hourly_remaining == 0

        # a takes it back: it counts b's 1,000, not its own 9,000 a second time
        assert store.release(POOL, "b", 2)
        assert acquire(store, a) == 3
        back = await a.m.take_over([POOL])
        assert back.hour_tokens == 1000
        assert a.svc.views.tenant_limits("acme").hourly_remaining == 0
        assert await a.serve("a9", 1, 1) == Reason.HOURLY_QUOTA

    run(ha_url, tmp_path, body)

"""Shares of one tenant's limits among replicas, end to end on a real
PostgreSQL (controlplane/ha/shares.py over store/shares.py, installed in
real AdmissionService instances): a tenant spread over four members with
twice its rate in demand is admitted about its rate in total, never more
than its rate plus one burst; shares follow demand; a crashed member's
share frees after the TTL, a drained one's at once; quota allowances keep
the sum of admissions within the hourly quota."""

from __future__ import annotations

import asyncio
import time
from decimal import Decimal

import pytest
from sqlalchemy import Engine

from controlplane.domain import Decision, LaneConfig, TenantConfig
from controlplane.ha.shares import TenantShares
from controlplane.service import AdmissionService, ServiceLimits
from controlplane.service.shares import PPM
from controlplane.settings import Settings
from controlplane.store.shares import ShareStore

pytestmark = pytest.mark.postgres

TTL, MARGIN, INTERVAL = 1.0, 0.25, 0.2
LANES = [LaneConfig("standard", 1, Decimal("1"), 800, False, True)]
RATE, BURST = 4000, 4000  # tokens/s, tokens
COST = 100  # tokens per request


async def member(engine: Engine, name: str, tenant: TenantConfig) -> TenantShares:
    svc = AdmissionService(ServiceLimits.of(Settings()))
    svc.apply_config([tenant], LANES)
    g = TenantShares(svc, ShareStore(engine), name, TTL, MARGIN, interval_s=INTERVAL)
    await g.start()
    return g


async def drive(g: TenantShares, tenant: str, every_s: float, until: float,
                admitted: list[int], tag: str) -> None:  # fmt: skip
    """Ask for one COST-token request every ``every_s`` until ``until``,
    as the RPC layer does: wait for a share first, then decide."""
    n = 0
    while time.monotonic() < until:
        await g.ensure([tenant])
        d = g.service.admit(tenant, f"{tag}-{n}", "", COST, 0)
        if d.decision == Decision.ADMIT:
            admitted.append(COST)
            g.service.complete(tenant, f"{tag}-{n}", d.reservation_id, COST, 0)
        n += 1
        await asyncio.sleep(every_s)


def test_a_tenant_spread_over_four_members_gets_its_rate_in_total(engine: Engine) -> None:
    spread = TenantConfig("spread", token_rate=Decimal(RATE), burst_tokens=BURST)
    seconds = 6.0

    async def scenario() -> tuple[int, dict[str, int]]:
        members = [await member(engine, f"m{i}", spread) for i in range(4)]
        admitted: list[int] = []
        until = time.monotonic() + seconds
        # demand 2x the rate: each member asks 2,000 tokens/s
        every = COST / (2 * RATE / 4)
        await asyncio.gather(*(drive(g, "spread", every, until, admitted, g.member_id)
                               for g in members))  # fmt: skip
        shares = {g.member_id: g.held().get("spread", None) for g in members}
        for g in members:
            await g.stop(release=True)
        return sum(admitted), {m: s.rate_ppm if s else 0 for m, s in shares.items()}

    total, shares = asyncio.run(scenario())
    print(f"\nspread over 4 members, demand 2x, {seconds:g} s: admitted {total} tokens"
          f" = {total / (RATE * seconds):.3f} x rate x time; shares {shares}")  # fmt: skip
    assert total <= RATE * seconds + BURST
    assert total >= 0.9 * RATE * seconds
    assert sum(shares.values()) <= PPM
    assert all(s >= PPM // 8 for s in shares.values())  # equal demand: about a quarter each


def test_shares_follow_demand_and_free_after_a_crash_or_a_drain(engine: Engine) -> None:
    t = TenantConfig("t", token_rate=Decimal(RATE), burst_tokens=BURST)

    async def scenario() -> None:
        a, b, c = [await member(engine, n, t) for n in ("a", "b", "c")]
        admitted: list[int] = []
        until = time.monotonic() + 2.0
        # a asks 3x what b asks; c asks nothing
        await asyncio.gather(drive(a, "t", 0.01, until, admitted, "a"),
                             drive(b, "t", 0.03, until, admitted, "b"))  # fmt: skip
        sa, sb = a.held()["t"].rate_ppm, b.held()["t"].rate_ppm
        assert sa + sb <= PPM
        assert sa > sb > 0, (sa, sb)
        assert c.held().get("t") is None or c.held()["t"].rate_ppm == 0  # no demand: nothing
        # a crashes (nothing released): b gets the whole rate only after a's TTL
        await a.stop(release=False)
        crashed = time.monotonic()
        until = crashed + TTL + 6 * INTERVAL
        while b.held()["t"].rate_ppm < PPM and time.monotonic() < until:
            await b.ensure(["t"])
            b.service.admit("t", f"b-{time.monotonic()}", "", COST, 0)
            await asyncio.sleep(0.02)
        took = time.monotonic() - crashed
        assert b.held()["t"].rate_ppm == PPM, b.held()
        assert took >= TTL - MARGIN - 2 * INTERVAL, took  # not before a's share ran out
        # b drains (released): c gets the whole rate at its next refreshes
        await b.stop(release=True)
        drained = time.monotonic()
        await c.ensure(["t"])
        until = drained + 6 * INTERVAL
        while c.held().get("t") is None or c.held()["t"].rate_ppm < PPM:
            assert time.monotonic() < until, c.held()
            await c.ensure(["t"])
            c.service.admit("t", f"c-{time.monotonic()}", "", COST, 0)
            await asyncio.sleep(0.02)
        assert time.monotonic() - drained < TTL - MARGIN  # before b's would have expired
        await c.stop(release=True)

    asyncio.run(scenario())


def test_quota_allowances_keep_the_sum_within_the_hourly_quota(engine: Engine) -> None:
    quota = 20_000
    q = TenantConfig("q", token_rate=Decimal(100_000), burst_tokens=100_000, hourly_quota=quota)

    async def scenario() -> int:
        members = [await member(engine, f"q{i}", q) for i in range(3)]
        admitted: list[int] = []
        until = time.monotonic() + 2.5
        await asyncio.gather(*(drive(g, "q", 0.005, until, admitted, g.member_id)
                               for g in members))  # fmt: skip
        for g in members:
            await g.stop(release=True)
        return sum(admitted)

    total = asyncio.run(scenario())
    assert total <= quota
    assert total >= quota - 3 * COST  # the quota is spent, not stranded

"""ShareStore on a real PostgreSQL: members refreshing overlapping tenants
at once never deadlock and never hold more than a tenant's limits between
them; grants converge; a dead member's rate frees after its TTL."""

from __future__ import annotations

import random
import threading
import time

import pytest
from sqlalchemy import Engine, text

from controlplane.domain.shares import PPM
from controlplane.store.db import make_engine
from controlplane.store.leases import HaUnsupported
from controlplane.store.shares import Ask, ShareStore, Window

pytestmark = pytest.mark.postgres

HOUR_START = 1_800_000_000 // 3600 * 3600
QUOTA = 100_000


def sums(engine: Engine) -> tuple[dict[str, int], dict[str, int]]:
    """Per tenant: the live rate grants' sum and the hour allowances' sum."""
    with engine.begin() as conn:
        rates: dict[str, object] = dict(conn.execute(text(
            "SELECT tenant_id, coalesce(sum(rate_ppm) FILTER (WHERE expires_at >"
            " clock_timestamp()), 0) FROM ha_tenant_rates GROUP BY tenant_id")).all())
        quotas: dict[str, object] = dict(conn.execute(text(
            "SELECT tenant_id, sum(allowance) FROM ha_tenant_quotas GROUP BY tenant_id")).all())
    return ({t: int(str(v)) for t, v in rates.items()},
            {t: int(str(v)) for t, v in quotas.items()})  # fmt: skip


def ask(tenant: str, demand: int, used: int = 0) -> Ask:
    return Ask(tenant, demand, hour=Window(HOUR_START, used, QUOTA))


def test_concurrent_members_stay_within_the_limits_and_converge(engine: Engine) -> None:
    store = ShareStore(engine)
    members, tenants = ["m1", "m2", "m3", "m4"], [f"t{i}" for i in range(12)]
    demand = {(m, t): random.Random(f"{m}{t}").randint(1, 1000) for m in members for t in tenants}
    errors: list[BaseException] = []
    spent: dict[tuple[str, str], int] = {}
    lock = threading.Lock()

    def member(me: str, seed: int) -> None:
        rnd = random.Random(seed)
        try:
            for _ in range(25):
                mine = rnd.sample(tenants, 8)  # overlapping sets, in any order
                with lock:
                    used = {t: spent.get((me, t), 0) for t in mine}
                grants = store.refresh(me, [ask(t, demand[(me, t)], used[t]) for t in mine], 30)
                with lock:  # spend within the allowance, as the service would
                    for t, g in grants.items():
                        assert g.hour_allowance is not None and g.hour_allowance >= used[t]
                        spent[(me, t)] = used[t] + rnd.randint(0, g.hour_allowance - used[t])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=member, args=(m, i)) for i, m in enumerate(members)]
    for th in threads:
        th.start()
    rates_seen: list[dict[str, int]] = []
    while any(th.is_alive() for th in threads):  # the sums, read while they refresh
        rates, quotas = sums(engine)
        rates_seen.append(rates)
        assert all(v <= PPM for v in rates.values()), rates
        assert all(v <= QUOTA for v in quotas.values()), quotas
        time.sleep(0.005)
    for th in threads:
        th.join()
    assert not errors, errors
    assert len(rates_seen) > 3  # the check ran while they worked
    # two more rounds over every tenant: the weighted shares
    for _ in range(2):
        for m in members:
            store.refresh(m, [ask(t, demand[(m, t)], spent.get((m, t), 0)) for t in tenants], 30)
    with engine.begin() as conn:
        got = {(m, t): int(r) for t, m, r in conn.execute(
            text("SELECT tenant_id, member_id, rate_ppm FROM ha_tenant_rates"))}  # fmt: skip
    for t in tenants:
        total = sum(demand[(m, t)] for m in members)
        for m in members:
            assert got[(m, t)] == demand[(m, t)] * PPM // total


def test_a_dead_members_rate_frees_after_its_ttl_and_release_frees_at_once(
    engine: Engine,
) -> None:
    store = ShareStore(engine)
    for me in ("a", "b", "a", "b"):
        store.refresh(me, [ask("t", 10)], 0.5 if me == "b" else 30)
    assert store.refresh("a", [ask("t", 10)], 30)["t"].rate_ppm == PPM // 2
    time.sleep(0.6)  # b's grant (0.5 s of database time) expires: it is not renewed
    assert store.refresh("a", [ask("t", 10)], 30)["t"].rate_ppm == PPM
    store.refresh("b", [ask("t", 10)], 30)  # b is back: gets what a leaves free (nothing)
    assert store.refresh("a", [ask("t", 10)], 30)["t"].rate_ppm == PPM // 2
    store.release("a")  # a graceful exit
    assert store.refresh("b", [ask("t", 10)], 30)["t"].rate_ppm == PPM


def test_a_member_id_restarted_resumes_from_its_row_and_a_release_frees_its_quota(
    engine: Engine,
) -> None:
    store = ShareStore(engine)
    a = store.refresh("m", [ask("t", 10, used=1000)], 30)["t"]
    assert a.hour_used == 1000 and a.hour_allowance == QUOTA  # alone: the whole quota
    # a restart keeping the id: its counters start at 0; the row says 1,000
    assert store.refresh("m", [ask("t", 10, used=0)], 30)["t"].hour_used == 1000
    # the first ask of the new process takes the old allowance as spent (a
    # kill -9 loses what was spent after the last refresh)
    first = Ask("t", 10, hour=Window(HOUR_START, 0, QUOTA), first=True)
    assert store.refresh("m", [first], 30)["t"].hour_used == QUOTA
    # a graceful release lowers the allowance to the use: another member gets the rest
    store.refresh("n", [ask("u", 10, used=0)], 30)
    store.release("n", [ask("u", 10, used=700)])
    b = store.refresh("o", [ask("u", 10)], 30)["u"]
    assert b.hour_others_used == 700 and b.hour_allowance == QUOTA - 700


def test_sqlite_is_refused(sqlite_url: str) -> None:
    eng = make_engine(sqlite_url)
    try:
        with pytest.raises(HaUnsupported, match="PostgreSQL"):
            ShareStore(eng)
    finally:
        eng.dispose()

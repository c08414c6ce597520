"""`serve` as three replicas on one PostgreSQL (issue 16, step 2; docs/ha.md):
cells spread, non-owners redirect (NOT_OWNER naming the owner), the unary
client and the SDK follow, GetCellOwners agrees everywhere, an AdmitStream
batch mixing owned and foreign pools, a drain hands off, a crash is taken
over after the TTL, and a Complete after a takeover is billed once.

Three in-process control planes (each its own loop, engine and gRPC port),
TTL 1 s. The tests run in file order on one module-scoped trio: the last two
stop replicas."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import grpc
import pytest
from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
from burstgate_client._proto.burstgate.v1 import admission_pb2_grpc as pb_grpc
from burstgate_client.protoclient import ProtoClient
from burstgate_client.redirects import not_owner
from burstgate_client.sdk import AsyncAdmissionClient

from controlplane.domain.rendezvous import assignment
from controlplane.store.db import upgrade
from tests.conftest import fresh_pg_database
from tests.integration.ha.harness import no_takeover_holds
from tests.integration.ledger.conftest import ledger_rows
from tests.integration.sdk.conftest import SLOW_OK, Plane, tenant
from tests.support import add_tenants, wait_until

pytestmark = pytest.mark.slow

POOLS = [f"p{i}" for i in range(8)]
HA = {"ha_lease_ttl_s": 1.0, "ha_margin_s": 0.25}


@pytest.fixture(scope="module")
def ha_db(pg_admin_dsn: str) -> Iterator[str]:
    for url in fresh_pg_database(pg_admin_dsn):
        upgrade(url)
        # one tenant per pool (AdmitStream entries resolve their pool from it)
        add_tenants(url, tenant("acme"), *(tenant(f"t-{p}", pool=p) for p in POOLS))
        yield url


@pytest.fixture(scope="module")
def trio(ha_db: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Plane]]:
    tmp = tmp_path_factory.mktemp("ha")
    planes = []
    for i in range(3):
        p = Plane(ha_db, {**HA, "ha_member_id": f"r{i}"}, tmp / f"spool-{i}")
        p.start()
        planes.append(p)
    # the first replica took every cell; the others get theirs handed off
    wanted = assignment([*POOLS, "default"], [f"r{i}" for i in range(3)])

    def settled() -> bool:
        return all(
            set(owned(p)) == {c for c, m in wanted.items() if m == f"r{i}"}
            for i, p in enumerate(planes)
        )

    wait_until(settled, message="the cells to spread over the three replicas")
    wait_until(
        lambda: no_takeover_holds(planes),
        message="the takeover holds of the handed-off cells to end",
    )

    def has_share(p: Plane, tenant_id: str) -> bool:
        assert p.srv is not None
        grants = p.srv.plane.ownership.shares
        return grants is not None and bool(p.srv.on_loop(lambda: grants.ready(tenant_id)))

    def homed() -> bool:  # each pool's tenant's rate gathered on the pool's owner
        return all(has_share(p, f"t-{pool}") for p in planes for pool in POOLS
                   if p.srv is not None and pool in owned(p))  # fmt: skip

    wait_until(homed, message="the tenants' shares to follow their cells")
    yield planes
    for p in planes:
        p.stop()
        if p.proxy is not None:
            p.proxy.close()


def owned(p: Plane) -> dict[str, int]:
    assert p.srv is not None
    coord = p.srv.plane.ownership.coordinator
    return dict(p.srv.on_loop(coord.owned))


def admit_req(pool: str, rid: str, tenant_id: str = "acme") -> pb.AdmitRequest:
    return pb.AdmitRequest(
        tenant_id=tenant_id, request_id=rid, prompt_tokens=10, max_tokens=10, pool=pool
    )


def owners_by_cell(target: str) -> dict[str, str]:
    with ProtoClient(target) as c:
        return {cell.cell: cell.owner_address for cell in c.cell_owners().cells}


def owner_of(planes: list[Plane], pool: str) -> Plane:
    """The replica whose Admit for ``pool`` is decided (the others redirect)."""
    found = []
    for p in planes:
        with ProtoClient(p.direct) as c:
            try:
                c.stub.Admit(admit_req(pool, f"probe-{pool}-{p.port}-{time.time_ns()}"), timeout=10)
            except grpc.RpcError as exc:
                where = not_owner(exc)
                assert where is not None, exc
                continue
        found.append(p)
    assert len(found) == 1, f"pool {pool}: decided by {[f.direct for f in found]}"
    return found[0]


def test_cells_spread_and_non_owners_redirect_to_the_owner(trio: list[Plane]) -> None:
    owners = {pool: owner_of(trio, pool) for pool in POOLS}
    assert len({o.direct for o in owners.values()}) >= 2  # spread (8 cells, 3 members)
    for pool, owner in owners.items():
        for p in trio:
            if p is owner:
                continue
            with ProtoClient(p.direct) as c, pytest.raises(grpc.RpcError) as err:
                c.stub.Admit(admit_req(pool, f"redirected-{pool}"), timeout=10)
            where = not_owner(err.value)
            assert where is not None
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert (where.owner, where.cell, where.pool) == (owner.direct, pool, pool)
            assert where.retry_s == 0


def test_get_cell_owners_agrees_across_replicas(trio: list[Plane]) -> None:
    def agreed() -> dict[str, str] | None:
        views = [owners_by_cell(p.direct) for p in trio]
        wanted = {pool: owner_of(trio, pool).direct for pool in POOLS}
        for v in views:
            if any(v.get(pool) != addr for pool, addr in wanted.items()):
                return None
        return views[0]

    view = wait_until(agreed, message="every replica to report the same owners")
    assert set(POOLS) <= set(view)
    with ProtoClient(trio[0].direct) as c:
        answer = c.cell_owners()
    assert sorted(m.address for m in answer.members) == sorted(p.direct for p in trio)
    assert answer.answered_by == "r0"
    mine = [cell for cell in answer.cells if cell.owner == "r0"]
    assert all(cell.epoch >= 1 and cell.lease_left_ms > 0 for cell in mine)
    with ProtoClient(trio[1].direct) as c:
        only = c.cell_owners("p3").cells
    assert [cell.cell for cell in only] == ["p3"] and list(only[0].pools) == ["p3"]


def test_the_unary_client_follows_a_redirect_and_bills_once(trio: list[Plane]) -> None:
    pool = next(p for p in POOLS if owner_of(trio, p) is not trio[0])
    with ProtoClient(trio[0].direct, timeout=10) as c:  # seeded with a non-owner
        d = c.admit("acme", "unary-1", prompt_tokens=10, max_tokens=10, pool=pool)
        assert d.decision == pb.DECISION_ADMIT
        assert c.redirects == 1 and c.owners[pool] == owner_of(trio, pool).direct
        done = c.complete("acme", "unary-1", prompt_tokens=10, generated_tokens=5, pool=pool)
        assert not done.duplicate
    rows = ledger_rows(trio[0].url, "request_id = 'unary-1'")
    assert len(rows) == 1


def test_the_sdk_follows_redirects_on_its_stream_and_bills_once(trio: list[Plane]) -> None:
    async def run() -> None:
        seeds = ",".join(p.direct for p in trio)
        async with AsyncAdmissionClient(
            seeds, deadline_s=SLOW_OK, connect_timeout_s=SLOW_OK
        ) as sdk:
            for i, pool in enumerate(POOLS):
                a = await sdk.admit("acme", f"sdk-{i}", prompt_tokens=10, max_tokens=10,
                                    pool=pool)  # fmt: skip
                assert a.admitted and not a.offline, a
                done = await sdk.complete("acme", f"sdk-{i}", prompt_tokens=10,
                                          generated_tokens=3)  # fmt: skip
                assert done.delivered and not done.duplicate
            assert sdk.counters.redirects >= 1

    asyncio.run(run())
    rows = ledger_rows(trio[0].url, "request_id LIKE 'sdk-%'")
    assert sorted(r.request_id for r in rows) == sorted(f"sdk-{i}" for i in range(len(POOLS)))


def test_an_admit_stream_batch_mixing_pools_refuses_only_foreign_entries(
    trio: list[Plane],
) -> None:
    here = trio[1]
    owned = {pool for pool in POOLS if owner_of(trio, pool) is here}
    assert owned and len(owned) < len(POOLS)
    tenants = [f"t-{pool}" for pool in POOLS]
    batch = pb.AdmitBatch(
        batch_id=7, tenant_id=tenants, request_id=[f"mix-{p}" for p in POOLS],
        prompt_tokens=[10] * len(POOLS), max_tokens=[10] * len(POOLS),
    )  # fmt: skip
    with grpc.insecure_channel(here.direct) as ch:
        (res,) = list(pb_grpc.AdmissionServiceStub(ch).AdmitStream(iter([batch]), timeout=10))
    for i, pool in enumerate(POOLS):
        if pool in owned:
            assert (res.decision[i], res.reason[i], res.owner[i]) == (pb.DECISION_ADMIT, 0, "")
        else:
            assert res.decision[i] == pb.DECISION_REJECT
            assert res.reason[i] == pb.REASON_NOT_OWNER and res.retryable[i]
            assert res.owner[i] == owner_of(trio, pool).direct
    # nothing was taken for the refused entries: the owner decides them afresh
    with ProtoClient(here.direct) as c:
        foreign = next(i for i, pool in enumerate(POOLS) if pool not in owned)
        d = c.admit(tenants[foreign], f"mix-{POOLS[foreign]}", prompt_tokens=10, max_tokens=10)
        assert d.decision == pb.DECISION_ADMIT and not d.duplicate


def handoff(trio: list[Plane], gone: Plane, how: str) -> tuple[float, dict[str, str]]:
    """Stop ``gone`` (drain, or crash = no release); the seconds until every
    cell it owned answers from a survivor, and the new owners."""
    mine = [pool for pool in POOLS if owner_of(trio, pool) is gone]
    assert mine, "the replica to stop owns no cell"
    live = [p for p in trio if p is not gone and p.srv is not None]
    assert gone.srv is not None
    started = time.monotonic()
    if how == "crash":
        gone.srv._run(gone.srv.plane.ownership.crash())
    gone.stop()

    def taken() -> dict[str, str] | None:
        try:
            return {pool: owner_of(live, pool).direct for pool in mine}
        except AssertionError:
            return None

    new = wait_until(taken, message=f"the cells of the {how}ed replica to be taken over")
    return time.monotonic() - started, new


def test_a_drain_hands_off_at_once_and_the_sdk_keeps_admitting(trio: list[Plane]) -> None:
    async def run() -> tuple[float, int]:
        seeds = ",".join(p.direct for p in trio)
        async with AsyncAdmissionClient(
            seeds, deadline_s=SLOW_OK, connect_timeout_s=SLOW_OK
        ) as sdk:
            for pool in POOLS:  # learn every owner first
                assert (await sdk.admit("acme", f"pre-{pool}", prompt_tokens=1, max_tokens=1,
                                        pool=pool)).admitted  # fmt: skip
            took, _ = await asyncio.to_thread(handoff, trio, trio[2], "drain")
            admitted = 0
            for pool in POOLS:
                a = await sdk.admit("acme", f"post-{pool}", prompt_tokens=1, max_tokens=1,
                                    pool=pool)  # fmt: skip
                assert not a.offline, a
                admitted += a.admitted
            return took, admitted

    took, admitted = asyncio.run(run())
    print(f"\ndrain handoff (TTL 1 s): cells owned again after {took:.2f} s")
    assert admitted == len(POOLS)


def test_a_crash_is_taken_over_after_the_ttl_and_a_late_complete_is_billed_once(
    trio: list[Plane],
) -> None:
    live = [p for p in trio if p.srv is not None]
    assert len(live) == 2
    victim = live[1]
    pool = next(p for p in POOLS if owner_of(live, p) is victim)

    async def run() -> float:
        seeds = ",".join(p.direct for p in live)
        async with AsyncAdmissionClient(
            seeds, deadline_s=SLOW_OK, connect_timeout_s=SLOW_OK
        ) as sdk:
            a = await sdk.admit("acme", "late-1", prompt_tokens=10, max_tokens=10, pool=pool)
            assert a.admitted and not a.offline
            took, new = await asyncio.to_thread(handoff, live, victim, "crash")
            assert new[pool] == live[0].direct
            done = await sdk.complete("acme", "late-1", prompt_tokens=10, generated_tokens=4)
            assert done.delivered, done
            return took

    took = asyncio.run(run())
    print(f"\ncrash takeover (TTL 1 s): cells owned again after {took:.2f} s")
    rows = ledger_rows(live[0].url, "request_id = 'late-1'")
    assert len(rows) == 1 and rows[0].output_tokens == 4
    # The new owner rebuilt the pool's pricing windows and quota usage under
    # its own lease (ReplicaWiring.cell_acquired -> Metering.take_over): its
    # window rows are written under that lease from now on.
    srv = live[0].srv
    assert srv is not None
    cp = srv.plane

    def rebuilt() -> bool:
        lease = srv.on_loop(lambda: cp.epoch_for_pool(pool))
        return lease is not None and srv.on_loop(
            lambda: cp.metering.windows.rebuilt_under(pool)) == lease  # fmt: skip

    wait_until(rebuilt, message="the new owner's takeover rebuild")

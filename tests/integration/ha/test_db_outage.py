"""Admission while the database is unreachable, on PostgreSQL (issue 30,
item 12; docs/ha.md, "Database outages").

Real servers on free ports, each reaching PostgreSQL through a TCP proxy
the test controls (tests/integration/ledger/proxy.py): ``cut`` refuses
connections, ``hang`` forwards nothing. TTL 1 s, margin 0.25 s.

- A lone replica (no other live member when it last read them) holds its
  leases for the lone TTL: it keeps admitting through an outage shorter
  than that, and every Complete it acknowledged meanwhile reaches the
  ledger when the database is back.
- Past the lone TTL it stops (bounded ride-through).
- A lone replica cut off while a new replica joins: the newcomer takes the
  cells only after the cut-off one stopped (never two deciders).
- Two live replicas, one cut off: it keeps its cells to its lease deadline,
  stops, and only then does the other take them over.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
from burstgate_client._proto.burstgate.v1 import admission_pb2_grpc as pb_grpc
from burstgate_client.redirects import not_owner
from sqlalchemy.engine import make_url

from controlplane.domain.rendezvous import assignment
from controlplane.ha.coordinator import Interval
from controlplane.store.db import upgrade
from tests.integration.ha.harness import no_takeover_holds
from tests.integration.ledger.conftest import ledger_rows_once
from tests.integration.ledger.proxy import TcpProxy
from tests.integration.sdk.conftest import Plane, tenant
from tests.support import add_tenants, wait_until

pytestmark = pytest.mark.slow

TTL = {"ha_lease_ttl_s": 1.0, "ha_margin_s": 0.25}
POOLS = [f"p{i}" for i in range(6)]


@pytest.fixture
def db(pg_url: str) -> str:
    upgrade(pg_url)
    add_tenants(pg_url, tenant("acme"))
    return pg_url


@pytest.fixture
def replicas(db: str, tmp_path: Path) -> Iterator[Callable[..., tuple[Plane, TcpProxy]]]:
    """``make(member, **settings)``: a server whose database connections go
    through a proxy of its own."""
    made: list[tuple[Plane, TcpProxy]] = []

    def make(member: str, **overrides: Any) -> tuple[Plane, TcpProxy]:
        url = make_url(db)
        proxy = TcpProxy((url.host or "127.0.0.1", url.port or 5432))
        proxied = url.set(port=proxy.port).render_as_string(hide_password=False)
        settings = {**TTL, "ha_member_id": member, "config_poll_s": 0.5, **overrides}
        p = Plane(proxied, settings, tmp_path / f"spool-{member}")
        made.append((p, proxy))
        p.start()
        return p, proxy

    yield make
    for _, proxy in made:
        proxy.restore()  # hung database threads return before the stop
    for p, proxy in made:
        p.stop()
        if p.proxy is not None:
            p.proxy.close()
        proxy.close()


def admit(stub: pb_grpc.AdmissionServiceStub, pool: str, rid: str) -> str:
    """The outcome of an Admit of ``pool``: "admitted", "not_owner" (a
    redirect), the refusal's reason, or the RPC's status code."""
    req = pb.AdmitRequest(tenant_id="acme", request_id=rid, prompt_tokens=10, max_tokens=10,
                          pool=pool)  # fmt: skip
    try:
        resp = stub.Admit(req, timeout=5)
    except grpc.RpcError as exc:
        return "not_owner" if not_owner(exc) is not None else exc.code().name
    if resp.decision == pb.DECISION_ADMIT:
        return "admitted"
    return pb.Reason.Name(resp.reason)


def history(p: Plane, cell: str) -> list[Interval]:
    """The closed lease intervals of ``cell`` on ``p`` (coordinator clock:
    time.monotonic, shared by the in-process servers)."""
    assert p.srv is not None
    coord = p.srv.plane.ownership.coordinator
    return [i for i in p.srv.on_loop(lambda: list(coord.history)) if i.cell == cell]


def owned(p: Plane) -> dict[str, int]:
    assert p.srv is not None
    coord = p.srv.plane.ownership.coordinator
    return dict(p.srv.on_loop(coord.owned))


def lease_start(p: Plane, cell: str) -> float:
    assert p.srv is not None
    coord = p.srv.plane.ownership.coordinator
    lease = p.srv.on_loop(lambda: coord.leases().get(cell))
    assert lease is not None, f"{cell} not held"
    return float(lease.valid_from)


@pytest.mark.parametrize("mode", ["cut", "hang"])
def test_a_lone_replica_admits_through_an_outage(
    replicas: Callable[..., tuple[Plane, TcpProxy]], db: str, mode: str
) -> None:
    solo, proxy = replicas("solo", ha_lone_lease_ttl_s=10.0)
    epoch = owned(solo)["default"]
    stub = pb_grpc.AdmissionServiceStub(grpc.insecure_channel(solo.direct))
    assert admit(stub, "", "before") == "admitted"

    getattr(proxy, mode)()
    cut_at = time.monotonic()
    outcomes: list[str] = []
    completed = []
    i = 0
    while time.monotonic() - cut_at < 4.0:  # four lease TTLs; the lone TTL is 10 s
        rid = f"r{i}"
        outcome = admit(stub, "", rid)
        outcomes.append(outcome)
        if outcome == "admitted" and i % 10 == 0:  # acknowledged from the spool
            done = pb.CompleteRequest(
                tenant_id="acme", request_id=rid, prompt_tokens=10, generated_tokens=5
            )
            stub.Complete(done, timeout=5)
            completed.append(rid)
        i += 1
        time.sleep(0.02)
    refused = [o for o in outcomes if o != "admitted"]
    assert not refused, f"{len(refused)} of {len(outcomes)} refused in the outage: {refused[:5]}"
    assert len(outcomes) > 50

    proxy.restore()
    # Every acknowledged Complete reaches the ledger, and the lease goes on
    # under the same epoch (renewed once the database answers: the database
    # never let it expire, nobody took it).
    rows = ledger_rows_once(db, len(completed), "request_id LIKE 'r%'")
    assert sorted(r.request_id for r in rows) == sorted(completed)
    assert owned(solo).get("default") == epoch
    assert admit(stub, "", "after") == "admitted"


def test_a_lone_replica_stops_after_the_lone_ttl(
    replicas: Callable[..., tuple[Plane, TcpProxy]],
) -> None:
    solo, proxy = replicas("solo", ha_lone_lease_ttl_s=2.0)
    stub = pb_grpc.AdmissionServiceStub(grpc.insecure_channel(solo.direct))
    assert admit(stub, "", "before") == "admitted"
    proxy.cut()
    cut_at = time.monotonic()
    # The ride-through is bounded: within the lone TTL of its last renew
    # (2 s, less the margin) it stops deciding.
    wait_until(
        lambda: admit(stub, "", f"x{time.monotonic_ns()}") == "not_owner",
        message="the lone replica to stop at its lone lease's deadline",
        timeout=10,
    )
    # the lone TTL (2 s), plus slack for a loaded 2-core machine (a run under
    # the whole suite in parallel took 4.6 s); riding on would never stop
    assert time.monotonic() - cut_at <= 2.0 + 4.0
    assert "default" not in owned(solo)


def test_a_newcomer_takes_a_cut_off_lone_replicas_cells_only_after_it_stopped(
    replicas: Callable[..., tuple[Plane, TcpProxy]],
) -> None:
    a, proxy_a = replicas("ra", ha_lone_lease_ttl_s=4.0)
    stub_a = pb_grpc.AdmissionServiceStub(grpc.insecure_channel(a.direct))
    assert admit(stub_a, "", "before") == "admitted"
    proxy_a.cut()
    cut_at = time.monotonic()
    b, _ = replicas("rb")  # reaches the database; A cannot
    stub_b = pb_grpc.AdmissionServiceStub(grpc.insecure_channel(b.direct))
    # A decides past its ordinary lease (TTL 1 s) ...
    a_admitted_at: list[float] = []
    while time.monotonic() - cut_at < 2.5:
        if admit(stub_a, "", f"a{len(a_admitted_at)}-{time.monotonic_ns()}") == "admitted":
            a_admitted_at.append(time.monotonic())
        assert admit(stub_b, "", f"b-{time.monotonic_ns()}") == "not_owner"
        time.sleep(0.02)
    assert a_admitted_at and a_admitted_at[-1] - cut_at > 2.0
    # ... and B takes the cell only after A's lone lease ran out.
    wait_until(lambda: "default" in owned(b), message="B to take the cell over", timeout=15)
    ended = history(a, "default")
    assert ended, "A never gave the cell up"
    assert ended[-1].valid_until <= lease_start(b, "default")
    assert admit(stub_a, "", "late") == "not_owner"


def test_two_replicas_the_cut_off_one_stops_before_the_other_takes_over(
    replicas: Callable[..., tuple[Plane, TcpProxy]], db: str
) -> None:
    add_tenants(db, *(tenant(f"t-{p}", pool=p) for p in POOLS))
    a, proxy_a = replicas("ra", ha_lone_lease_ttl_s=30.0)
    b, _ = replicas("rb", ha_lone_lease_ttl_s=30.0)
    wanted = assignment([*POOLS, "default"], ["ra", "rb"])
    wait_until(lambda: set(owned(a)) == {c for c, m in wanted.items() if m == "ra"}
               and set(owned(b)) == {c for c, m in wanted.items() if m == "rb"},
               message="the cells to spread over both replicas")  # fmt: skip
    wait_until(lambda: no_takeover_holds([a, b]), message="the handoff holds to end")
    pool = next(c for c, m in wanted.items() if m == "ra" and c != "default")
    stub_a = pb_grpc.AdmissionServiceStub(grpc.insecure_channel(a.direct))
    stub_b = pb_grpc.AdmissionServiceStub(grpc.insecure_channel(b.direct))
    assert admit(stub_a, pool, "before") == "admitted"

    proxy_a.cut()
    cut_at = time.monotonic()
    seen: list[tuple[float, str, str]] = []
    while time.monotonic() - cut_at < 6.0:
        seen.append((time.monotonic(), "a", admit(stub_a, pool, f"a-{time.monotonic_ns()}")))
        seen.append((time.monotonic(), "b", admit(stub_b, pool, f"b-{time.monotonic_ns()}")))
        time.sleep(0.02)
    a_ok = [t for t, who, o in seen if who == "a" and o == "admitted"]
    b_ok = [t for t, who, o in seen if who == "b" and o == "admitted"]
    assert a_ok and b_ok, "A decided before the cut ends, B after its takeover"
    # A (not alone: B is live) keeps the cell only to its lease deadline; B
    # decides only after A stopped: never both.
    assert max(a_ok) < min(b_ok)
    assert max(a_ok) - cut_at < 1.0 + 0.5  # at most the TTL after its last renew, + slack
    ended = history(a, pool)
    assert ended and ended[-1].valid_until <= lease_start(b, pool)
    assert pool not in owned(a)

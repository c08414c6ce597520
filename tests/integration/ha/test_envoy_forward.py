"""Envoy's rate-limit service owner-gated across three replicas (docs/envoy.md,
"Several replicas"): a ShouldRateLimit sent to a replica that does not own
the pool's cell is forwarded to the owner, which decides it; the caller's
key goes with it; one hop at most; a dead owner is answered OVER_LIMIT with
retry-after until the cell is taken over, then the new owner decides.

Three in-process control planes on one PostgreSQL (TTL 1 s), admission auth
on, real gRPC. The tests run in file order on one module-scoped trio; the
last one crashes a replica. LISTEN/NOTIFY is off and the config poll slow,
so that a key revoked in the database reaches only the replica the test
refreshes (the auth pass-through test)."""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Iterator
from decimal import Decimal

import grpc
import pytest

from controlplane._proto.envoy.service.ratelimit.v3 import rls_pb2 as rls
from controlplane._proto.envoy.service.ratelimit.v3 import rls_pb2_grpc as rls_grpc
from controlplane.domain.audit import Actor
from controlplane.domain.keys import Role
from controlplane.domain.rendezvous import assignment
from controlplane.ha.serving import Redirect
from controlplane.integrations.envoy.forward import HOP_HEADER
from controlplane.service import RecordView
from controlplane.store.db import make_engine, upgrade
from controlplane.store.keys import KeyStore
from tests.conftest import fresh_pg_database
from tests.integration.envoy.conftest import DEPLOY
from tests.integration.ha.harness import no_takeover_holds
from tests.integration.ledger.conftest import ledger_rows
from tests.integration.sdk.conftest import Plane, tenant
from tests.support import add_tenants, wait_until

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

POOLS = [f"p{i}" for i in range(7)]
OK, OVER = rls.RateLimitResponse.OK, rls.RateLimitResponse.OVER_LIMIT
SETTINGS = {
    "ha_lease_ttl_s": 1.0, "ha_margin_s": 0.25, "admission_auth": True,
    "envoy_rls_config": DEPLOY / "burstgate-envoy.yaml",
    "listen_notify": False, "config_poll_s": 60.0,
}  # fmt: skip
# the bucket fits one 1,500-token call; the refill is negligible
TINY = {"token_rate": Decimal(1), "burst_tokens": 1500}


def make_key(url: str, name: str, tenants: list[str]) -> tuple[str, str]:
    engine = make_engine(url)
    try:
        key, info = KeyStore(engine).create_key(
            name, Role.SIDECAR, Actor("local:test", "local"), tenants=tenants, pools=["*"]
        )
    finally:
        engine.dispose()
    return key, info.key_id


class Trio:
    def __init__(self, url: str, planes: list[Plane], key: str, key_id: str) -> None:
        self.url, self.planes, self.key, self.key_id = url, planes, key, key_id

    def owner(self, pool: str) -> Plane:
        live = [p for p in self.planes if p.srv is not None]
        found = [p for p in live if owns(p, pool)]
        assert len(found) == 1, f"{pool}: owned by {[p.direct for p in found]}"
        return found[0]

    def other(self, pool: str) -> Plane:
        return next(p for p in self.planes if p.srv is not None and p is not self.owner(pool))


def owns(p: Plane, pool: str) -> bool:
    srv = p.srv
    assert srv is not None
    return bool(srv.on_loop(lambda: srv.plane.ownership.owned_now(pool)))


@pytest.fixture(scope="module")
def trio(pg_admin_dsn: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trio]:
    tmp = tmp_path_factory.mktemp("ha-envoy")
    for url in fresh_pg_database(pg_admin_dsn):
        upgrade(url)
        tenants = [tenant("acme"), *(tenant(f"tiny-{i}", **TINY) for i in range(3))]
        # tenants naming the pools: the config's pools are coordinated from the start
        add_tenants(url, *tenants, *(tenant(f"t-{p}", pool=p) for p in POOLS))
        key, key_id = make_key(url, "envoy", [t.tenant_id for t in tenants])
        planes = []
        for i in range(3):
            p = Plane(url, {**SETTINGS, "ha_member_id": f"r{i}"}, tmp / f"spool-{i}")
            p.start()
            planes.append(p)
        wanted = assignment([*POOLS, "default"], [f"r{i}" for i in range(3)])

        def settled(planes: list[Plane] = planes, wanted: dict[str, str] = wanted) -> bool:
            return all(owns(planes[int(m[1])], c) for c, m in wanted.items())

        wait_until(settled, message="the cells to spread over the three replicas")

        wait_until(functools.partial(no_takeover_holds, planes),
                   message="the takeover holds of the handed-off cells to end")

        def shared(planes: list[Plane] = planes) -> bool:
            # acme is decided on every replica here: each holds a share of its
            # rate (asked for on all three, as traffic would; docs/ha.md)
            ok = True
            for p in planes:
                assert p.srv is not None
                grants = p.srv.plane.ownership.shares
                assert grants is not None
                ask_ = functools.partial(grants.ask_soon, ["acme"])
                p.srv.on_loop(ask_)
                ok = ok and bool(p.srv.on_loop(functools.partial(grants.ready, "acme")))
            return ok

        wait_until(shared, message="a share of acme's rate on every replica")
        try:
            yield Trio(url, planes, key, key_id)
        finally:
            for p in planes:
                p.stop()
                if p.proxy is not None:
                    p.proxy.close()


def ask(tenant_id: str, rid: str, pool: str, *, tokens: int = 0,
        usage: tuple[int, int] | None = None) -> rls.RateLimitRequest:  # fmt: skip
    """Envoy's request-path call (or with ``usage``, its stream-done call)."""
    req = rls.RateLimitRequest(domain="burstgate")
    d = req.descriptors.add()
    for k, v in (("tenant", tenant_id), ("request_id", rid), ("pool", pool)):
        d.entries.add(key=k, value=v)
    if usage is not None:
        d.entries.add(key="phase", value="response")
        d.entries.add(key="prompt_tokens", value=str(usage[0]))
        d.entries.add(key="completion_tokens", value=str(usage[1]))
        tokens = sum(usage)
    if tokens:
        d.hits_addend.value = tokens
    return req


def call(p: Plane, req: rls.RateLimitRequest, key: str, *, timeout: float = 10.0,
         extra: tuple[tuple[str, str], ...] = ()) -> rls.RateLimitResponse:  # fmt: skip
    with grpc.insecure_channel(p.direct) as ch:
        out: rls.RateLimitResponse = rls_grpc.RateLimitServiceStub(ch).ShouldRateLimit(
            req, metadata=[("authorization", f"Bearer {key}"), *extra], timeout=timeout
        )
    return out


def headers(resp: rls.RateLimitResponse) -> dict[str, str]:
    return {h.key: h.value for h in resp.response_headers_to_add}


def record(p: Plane, tenant_id: str, rid: str) -> RecordView | None:
    srv = p.srv
    assert srv is not None
    views = srv.plane.service.views
    found: RecordView | None = srv.on_loop(lambda: views.record(tenant_id, rid))
    return found


def counts(p: Plane) -> dict[str, int]:
    srv = p.srv
    assert srv is not None
    rls_servicer = srv.plane.envoy_rls
    return dict(srv.on_loop(lambda: {**rls_servicer.calls, **rls_servicer.gate.counts}))


def test_a_call_to_a_non_owner_is_decided_by_the_owner(trio: Trio) -> None:
    pool = POOLS[0]
    owner, other = trio.owner(pool), trio.other(pool)
    # the owner's bucket of tiny-0 is spent by a call made to it directly;
    # the other replica's own bucket of tiny-0 is full (never touched)
    assert call(owner, ask("tiny-0", "direct", pool, tokens=1500), trio.key).overall_code == OK
    before_owner, before_other = counts(owner), counts(other)
    resp = call(other, ask("tiny-0", "via-other", pool, tokens=1500), trio.key)
    # the owner's answer: its empty bucket refuses; the other would have admitted
    assert resp.overall_code == OVER
    assert headers(resp)["x-burstgate-reason"] == "token_rate"
    assert record(owner, "tiny-0", "via-other") is not None
    assert record(other, "tiny-0", "via-other") is None
    after_owner, after_other = counts(owner), counts(other)
    assert after_owner["admit"] == before_owner["admit"] + 1
    assert after_other["admit"] == before_other["admit"]
    assert after_other["forwarded"] == before_other["forwarded"] + 1
    # an admitted one: reserved on the owner only
    rid = uuid.uuid4().hex
    assert call(other, ask("acme", rid, pool), trio.key).overall_code == OK
    rec = record(owner, "acme", rid)
    assert rec is not None and rec.is_open
    assert record(other, "acme", rid) is None
    srv = other.srv
    assert srv is not None
    assert srv.plane.envoy_rls.gate.channels == [owner.direct]  # one channel, reused


def test_a_forwarded_stream_done_call_settles_the_reservation_once(trio: Trio) -> None:
    pool = POOLS[1]
    owner, other = trio.owner(pool), trio.other(pool)
    third = next(p for p in trio.planes if p is not owner and p is not other)
    rid = uuid.uuid4().hex
    assert call(other, ask("acme", rid, pool), trio.key).overall_code == OK
    done = ask("acme", rid, pool, usage=(30, 70))
    assert call(third, done, trio.key).overall_code == OK  # through another non-owner
    assert call(other, done, trio.key).overall_code == OK  # a repeated delivery
    rec = record(owner, "acme", rid)
    assert rec is not None and rec.is_settled
    rows = wait_until(lambda: ledger_rows(trio.url, f"request_id = '{rid}'"),
                      message="the ledger row")  # fmt: skip
    time.sleep(0.3)  # a second row would be written by now
    rows = ledger_rows(trio.url, f"request_id = '{rid}'")
    assert [(r.reserved_tokens, r.prompt_tokens, r.output_tokens) for r in rows] == [(1024, 30, 70)]
    assert counts(other)["settle"] == 0 and counts(third)["settle"] == 0


def test_the_key_passes_through_and_the_owner_checks_it(trio: Trio) -> None:
    pool = POOLS[2]
    owner, other = trio.owner(pool), trio.other(pool)
    # a key scoped to another tenant: the owner applies its scope
    scoped, _ = make_key(trio.url, "scoped", ["tiny-2"])
    for p in trio.planes:
        srv = p.srv
        assert srv is not None
        srv.on_loop(srv.plane.key_cache.refresh)
    resp = call(other, ask("acme", uuid.uuid4().hex, pool), scoped)
    assert resp.overall_code == OVER and "acme" in headers(resp)["x-burstgate-error"]
    # revoked, and only the owner knows it yet: the other replica lets the
    # call in and forwards it; the owner refuses the key; Envoy gets the
    # owner's UNAUTHENTICATED (as a replica refusing the key itself answers)
    engine = make_engine(trio.url)
    try:
        KeyStore(engine).revoke_key(trio.key_id, Actor("local:test", "local"))
    finally:
        engine.dispose()
    osrv, xsrv = owner.srv, other.srv
    assert osrv is not None and xsrv is not None
    osrv.on_loop(osrv.plane.key_cache.refresh)
    refused_owner = osrv.on_loop(lambda: sum(osrv.plane.rpc_stats.auth_failures.values()))
    refused_other = xsrv.on_loop(lambda: sum(xsrv.plane.rpc_stats.auth_failures.values()))
    with pytest.raises(grpc.RpcError) as err:
        call(other, ask("acme", uuid.uuid4().hex, pool), trio.key)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert osrv.on_loop(lambda: sum(osrv.plane.rpc_stats.auth_failures.values())) == (
        refused_owner + 1
    )
    assert xsrv.on_loop(lambda: sum(xsrv.plane.rpc_stats.auth_failures.values())) == refused_other
    assert counts(other)["owner_error"] >= 1
    # every replica learns the revocation; the tests after use a new key
    for p in trio.planes:
        srv = p.srv
        assert srv is not None
        srv.on_loop(srv.plane.key_cache.refresh)
    trio.key, trio.key_id = make_key(trio.url, "envoy-2", ["acme", "tiny-0", "tiny-1"])
    for p in trio.planes:
        srv = p.srv
        assert srv is not None
        srv.on_loop(srv.plane.key_cache.refresh)


def test_a_forwarded_call_is_not_forwarded_again(trio: Trio) -> None:
    pool = POOLS[3]
    owner, other = trio.owner(pool), trio.other(pool)
    rid = uuid.uuid4().hex
    before = counts(other)["hop_limit"]
    resp = call(other, ask("acme", rid, pool), trio.key, extra=((HOP_HEADER, "r9"),))
    assert resp.overall_code == OVER
    h = headers(resp)
    assert (h["x-burstgate-reason"], h["retry-after"]) == ("not_owner", "1")
    assert counts(other)["hop_limit"] == before + 1
    assert record(owner, "acme", rid) is None and record(other, "acme", rid) is None
    # the owner decides a forwarded call for its own cell
    assert call(owner, ask("acme", rid, pool), trio.key, extra=((HOP_HEADER, "r9"),)
                ).overall_code == OK  # fmt: skip


def test_a_stale_route_is_looked_up_again_within_the_call(trio: Trio) -> None:
    pool = POOLS[5]
    owner, caller = trio.owner(pool), trio.other(pool)
    stale = next(p for p in trio.planes if p is not owner and p is not caller)
    srv = caller.srv
    assert srv is not None
    own = srv.plane.ownership
    # the caller's lease snapshot names a member that is not the owner (as
    # after a handoff it has not read yet); that member refuses the call
    # (hop limit) and the caller asks the route again: the owner decides
    own.leased_owner = lambda p: Redirect(p, p, "stale", stale.direct, 1)
    before = srv.on_loop(lambda: srv.plane.envoy_rls.gate.stale_routes)
    try:
        rid = uuid.uuid4().hex
        assert call(caller, ask("acme", rid, pool), trio.key).overall_code == OK
    finally:
        del own.leased_owner  # the class's method again
    assert srv.on_loop(lambda: srv.plane.envoy_rls.gate.stale_routes) == before + 1
    assert record(owner, "acme", rid) is not None
    assert record(stale, "acme", rid) is None and record(caller, "acme", rid) is None


def test_a_dead_owner_is_over_limit_until_taken_over_then_the_new_owner_decides(
    trio: Trio,
) -> None:
    pool = POOLS[4]
    victim = trio.owner(pool)
    caller = trio.other(pool)
    assert victim.srv is not None
    crashed = time.monotonic()
    victim.srv._run(victim.srv.plane.ownership.crash())  # nothing released
    victim.stop()
    stopped = time.monotonic()
    # Envoy's timeout in deploy/envoy/envoy.yaml: answered within it, not an error
    resp = call(caller, ask("acme", uuid.uuid4().hex, pool), trio.key, timeout=0.25)
    answered = time.monotonic()
    print(f"\ncrash->stopped {stopped - crashed:.3f} s, call {answered - stopped:.3f} s")
    assert resp.overall_code == OVER, "decided before the lease of the dead owner ran out"
    h = headers(resp)
    assert (h["x-burstgate-reason"], h["retry-after"]) == ("not_owner", "1")
    gave_up = counts(caller)
    assert gave_up["unreachable"] + gave_up["timeout"] >= 1
    rid = uuid.uuid4().hex

    def decided() -> rls.RateLimitResponse | None:
        try:
            r = call(caller, ask("acme", rid, pool), trio.key, timeout=0.25)
        except grpc.RpcError as exc:  # a loaded machine: past Envoy's 0.25 s, try again
            if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
            return None
        return r if r.overall_code == OK else None

    wait_until(decided, message="the new owner to decide the dead owner's pool")
    survivors = [p for p in trio.planes if p.srv is not None]
    holders = [p for p in survivors if record(p, "acme", rid) is not None]
    assert holders == [trio.owner(pool)]

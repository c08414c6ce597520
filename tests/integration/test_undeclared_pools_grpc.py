"""Issue 30 item 8: pools are declared by operators (docs/operating.md,
"Declaring pools"). An undeclared pool is refused INVALID_ARGUMENT naming
the pool at every door - Admit, AdmitStream (with and without waiting),
Complete, an offline Complete, Reannounce, ReportLoad and Envoy's
rate-limit service - including for a key that is refused
PERMISSION_DENIED, and creates no state: no lease row (PostgreSQL: one
replica runs the cell coordinator), no pool view. And a cell with no
traffic is released instead of renewed forever (PostgreSQL).

Real gRPC servers on free ports; SQLite and PostgreSQL."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import grpc
import pytest
from burstgate_client._proto.burstgate.v1 import admission_pb2_grpc as pb_grpc
from burstgate_client.protoclient import make_batch, pb
from sqlalchemy import text

from controlplane._proto.envoy.service.ratelimit.v3 import rls_pb2 as rls
from controlplane._proto.envoy.service.ratelimit.v3 import rls_pb2_grpc as rls_grpc
from controlplane.domain import TenantConfig
from controlplane.domain.audit import Actor
from controlplane.domain.keys import Role
from controlplane.domain.policy import Policy
from controlplane.store.db import make_engine
from controlplane.store.keys import KeyStore
from tests.integration.envoy.conftest import DEPLOY
from tests.support import add_tenants, wait_until

MADE_UP = "made-up-pool"


def lease_rows(url: str) -> dict[str, tuple[str | None, int, Any]]:
    """cell -> (owner, epoch, expires_at) of ha_cell_leases (none on SQLite:
    one replica, no coordinator)."""
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            if engine.dialect.name != "postgresql":
                return {}
            rows = conn.execute(
                text("SELECT cell_id, owner, epoch, expires_at FROM ha_cell_leases")
            )
            return {cell: (owner, epoch, exp) for cell, owner, epoch, exp in rows}
    finally:
        engine.dispose()


def make_key(url: str, tenants: list[str], pools: list[str]) -> str:
    engine = make_engine(url)
    try:
        key, _ = KeyStore(engine).create_key(
            f"k-{uuid.uuid4().hex[:8]}", Role.SIDECAR, Actor("local:test", "local"),
            tenants=tenants, pools=pools,
        )  # fmt: skip
    finally:
        engine.dispose()
    return key


def rls_ask(tenant_id: str, rid: str, pool: str, tokens: int = 10) -> rls.RateLimitRequest:
    req = rls.RateLimitRequest(domain="burstgate")
    d = req.descriptors.add()
    for k, v in (("tenant", tenant_id), ("request_id", rid), ("pool", pool)):
        d.entries.add(key=k, value=v)
    d.hits_addend.value = tokens
    return req


def load(pool: str) -> pb.LoadReport:
    return pb.LoadReport(
        pool=pool, engine_id="e0", max_batch_tokens=8192, queue_capacity=256,
        kv_cache_miss_rate=0.0,
    )  # fmt: skip


def admit(rid: str, pool: str) -> pb.AdmitRequest:
    return pb.AdmitRequest(
        tenant_id="acme", request_id=rid, prompt_tokens=1, max_tokens=1, pool=pool
    )


def reservation(rid: str, pool: str) -> pb.OpenReservation:
    return pb.OpenReservation(
        tenant_id="acme", request_id=rid, prompt_tokens=10, max_tokens=20, reserved_tokens=30,
        granted_max_tokens=20, pricing_multiplier="1.000000", pool=pool,
    )  # fmt: skip


def doors(target: str, key: str | None, pool: str) -> dict[str, Callable[[], Any]]:
    """Every door, each called once with ``pool`` (fresh request ids)."""
    md = [("authorization", f"Bearer {key}")] if key else []
    ch = grpc.insecure_channel(target)
    stub = pb_grpc.AdmissionServiceStub(ch)
    rls_stub = rls_grpc.RateLimitServiceStub(ch)

    def rid() -> str:
        return uuid.uuid4().hex

    def stream(batch: pb.AdmitBatch) -> Any:
        return next(iter(stub.AdmitStream(iter([batch]), metadata=md, timeout=10)))

    waiting = make_batch(1, ["acme"], [rid()], [1], [1], pool=pool)
    waiting.max_wait_ms.append(100)
    return {
        "Admit": lambda: stub.Admit(admit(rid(), pool), metadata=md, timeout=10),
        "AdmitStream": lambda: stream(make_batch(1, ["acme"], [rid()], [1], [1], pool=pool)),
        "AdmitStream waiting": lambda: stream(waiting),
        "Complete": lambda: stub.Complete(
            pb.CompleteRequest(
                tenant_id="acme", request_id=rid(), prompt_tokens=1, generated_tokens=1, pool=pool
            ),
            metadata=md,
            timeout=10,
        ),
        "offline Complete": lambda: stub.Complete(
            pb.CompleteRequest(
                tenant_id="acme",
                request_id=rid(),
                prompt_tokens=1,
                generated_tokens=1,
                offline=pb.OfflineAdmission(pool=pool),
            ),
            metadata=md,
            timeout=10,
        ),
        "Reannounce": lambda: stub.Reannounce(
            pb.ReannounceRequest(reservations=[reservation(rid(), pool)]), metadata=md, timeout=10
        ),
        "ReportLoad": lambda: stub.ReportLoad(load(pool), metadata=md, timeout=10),
        "Envoy RLS": lambda: rls_stub.ShouldRateLimit(
            rls_ask("acme", rid(), pool), metadata=md, timeout=10
        ),
    }


def refusal(call: Callable[[], Any]) -> tuple[str, str]:
    """(status code name, message) of a refused call; Envoy's door answers
    OVER_LIMIT with the error in x-burstgate-error."""
    try:
        out = call()
    except grpc.RpcError as exc:
        return exc.code().name, exc.details() or ""
    if isinstance(out, rls.RateLimitResponse):
        hdr = {h.key: h.value for h in out.response_headers_to_add}
        assert out.overall_code == rls.RateLimitResponse.OVER_LIMIT, hdr
        return "OVER_LIMIT", hdr.get("x-burstgate-error", "")
    raise AssertionError(f"not refused: {out}")


def test_an_undeclared_pool_is_refused_at_every_door_and_makes_no_state(
    migrated_url: str, make_server: Callable[..., Any]
) -> None:
    add_tenants(
        migrated_url,
        TenantConfig(tenant_id="acme", token_rate=Decimal(1000), burst_tokens=10**6, pool="gpu-a"),
    )
    every = make_key(migrated_url, ["*"], ["*"])
    scoped = make_key(migrated_url, ["acme"], ["gpu-a"])
    srv = make_server(
        migrated_url, admission_auth=True, envoy_rls_config=DEPLOY / "burstgate-envoy.yaml",
        policy=Policy(known_pools=["gpu-b"]),
    )  # fmt: skip
    before = lease_rows(migrated_url)
    if srv.plane.engine.dialect.name == "postgresql":  # the declared cells, taken at start
        assert {"default", "gpu-a", "gpu-b"} <= set(before)
    for key, codes in ((every, {"INVALID_ARGUMENT"}),
                       (scoped, {"INVALID_ARGUMENT", "PERMISSION_DENIED"})):  # fmt: skip
        for door, call in doors(srv.target, key, MADE_UP).items():
            code, message = refusal(call)
            if door == "Envoy RLS":
                assert code == "OVER_LIMIT", door
            else:
                assert code in codes, (door, code, message)
            assert repr(MADE_UP) in message, (door, message)
            if code != "PERMISSION_DENIED":  # the declared pools are listed
                assert "not declared" in message and "gpu-a, gpu-b" in message, (door, message)
    # nothing was made for the pool: no lease row, no pool view, no record
    assert set(lease_rows(migrated_url)) == set(before)
    assert srv.on_loop(lambda: MADE_UP not in srv.plane.service.views.pools)
    assert srv.on_loop(lambda: MADE_UP not in srv.plane.service.views.pool_views())
    assert srv.on_loop(lambda: srv.plane.service.views.open_reservations) == 0
    # the declared pools are served
    md = [("authorization", f"Bearer {every}")]
    with grpc.insecure_channel(srv.target) as ch:
        stub = pb_grpc.AdmissionServiceStub(ch)
        for pool in ("gpu-a", "gpu-b", "default"):
            d = stub.Admit(admit(f"ok-{pool}", pool), metadata=md, timeout=10)
            assert d.decision == pb.DECISION_ADMIT, pool
        assert stub.ReportLoad(load("gpu-b"), metadata=md, timeout=10).engines_reporting == 1


@pytest.mark.postgres
def test_a_cell_with_no_traffic_is_released_and_claimed_again_on_demand(
    pg_url: str, make_server: Callable[..., Any]
) -> None:
    from controlplane.store.db import upgrade

    upgrade(pg_url)
    add_tenants(
        pg_url,
        TenantConfig(tenant_id="acme", token_rate=Decimal(1000), burst_tokens=10**6, pool="gpu-a"),
    )
    scoped = make_key(pg_url, ["acme"], ["gpu-b"])
    every = make_key(pg_url, ["*"], ["*"])
    srv = make_server(
        pg_url, admission_auth=True, ha_lease_ttl_s=1.0, ha_margin_s=0.25,
        reservation_ttl_s=1.0, ha_cell_idle_s=1.5, policy=Policy(known_pools=["gpu-b"]),
    )  # fmt: skip
    rows = lease_rows(pg_url)
    assert all(rows[c][0] for c in ("default", "gpu-a", "gpu-b")), rows  # owned at start

    def released() -> bool:
        now = lease_rows(pg_url)
        return all(now[c][0] is None for c in ("default", "gpu-a", "gpu-b"))

    wait_until(released, timeout=15, message="the idle cells to be released")
    idle = lease_rows(pg_url)
    time.sleep(1.5)  # more than a lease TTL: a renewed lease would have moved
    assert lease_rows(pg_url) == idle  # not renewed, not re-acquired
    # a key refused PERMISSION_DENIED claims nothing
    with grpc.insecure_channel(srv.target) as ch:
        stub = pb_grpc.AdmissionServiceStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.Admit(admit("pd", "gpu-a"), metadata=[("authorization", f"Bearer {scoped}")],
                       timeout=10)  # fmt: skip
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert lease_rows(pg_url)["gpu-a"][0] is None
        # traffic claims the cell again on demand
        md = [("authorization", f"Bearer {every}")]
        d = stub.Admit(admit("again", "gpu-a"), metadata=md, timeout=10)
        assert d.decision == pb.DECISION_ADMIT
        owner, epoch, _ = lease_rows(pg_url)["gpu-a"]
        assert owner is not None and epoch > idle["gpu-a"][1]
        stub.Complete(pb.CompleteRequest(tenant_id="acme", request_id="again", prompt_tokens=1,
                                         generated_tokens=1), metadata=md, timeout=10)  # fmt: skip
    assert srv.on_loop(lambda: srv.plane.ownership.idle_released_total) >= 3
    wait_until(lambda: lease_rows(pg_url)["gpu-a"][0] is None, timeout=15,
               message="gpu-a released again once idle")  # fmt: skip

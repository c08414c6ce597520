"""Every AdminService RPC over real gRPC, on SQLite and PostgreSQL."""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import grpc
from burstgate_client._proto.burstgate.v1 import admin_pb2 as apb
from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
from google.protobuf.field_mask_pb2 import FieldMask

from tests.integration.admin.conftest import Env, code_of


def test_create_get_list_pages(env: Env) -> None:
    t = env.admin.call(
        "CreateTenant",
        apb.CreateTenantRequest(
            tenant=apb.Tenant(
                tenant_id="gamma", token_rate="12.5", burst_tokens=500, hourly_quota=9
            )
        ),
    )
    assert (t.tenant_id, t.token_rate, t.burst_tokens, t.hourly_quota) == ("gamma", "12.5", 500, 9)
    assert t.enabled and t.demote_long_requests and t.default_lane == "standard"
    assert not t.HasField("daily_quota") and t.create_time.seconds > 0
    assert env.tenant("gamma") == t
    code, details = code_of(
        lambda: env.admin.call("CreateTenant", apb.CreateTenantRequest(tenant=t))
    )
    assert code == grpc.StatusCode.ALREADY_EXISTS and details.startswith("tenant_id")
    for i in range(4):
        env.admin.call(
            "CreateTenant",
            apb.CreateTenantRequest(
                tenant=apb.Tenant(tenant_id=f"t{i}", token_rate="1", burst_tokens=1)
            ),
        )
    pages, token = [], ""
    while True:
        r = env.admin.call("ListTenants", apb.ListTenantsRequest(page_size=3, page_token=token))
        pages.append([x.tenant_id for x in r.tenants])
        token = r.next_page_token
        if not token:
            break
    assert pages == [["acme", "beta", "gamma"], ["t0", "t1", "t2"], ["t3"]]
    assert [x.tenant_id for x in env.viewer.list_tenants()][:2] == ["acme", "beta"]
    code, details = code_of(lambda: env.tenant("nobody"))
    assert code == grpc.StatusCode.NOT_FOUND and details.startswith("tenant_id")
    code, _ = code_of(
        lambda: env.admin.call("ListTenants", apb.ListTenantsRequest(page_token="!!"))
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_create_is_live_and_validated(env: Env) -> None:
    assert env.admit("gamma", "r0").reason == pb.REASON_UNKNOWN_TENANT
    env.admin.call(
        "CreateTenant",
        apb.CreateTenantRequest(
            tenant=apb.Tenant(tenant_id="gamma", token_rate="10", burst_tokens=50)
        ),
    )
    assert env.admit("gamma", "r1", prompt=40).decision == pb.DECISION_ADMIT

    def bad(**kw: Any) -> apb.Tenant:
        base: dict[str, Any] = {"tenant_id": "x", "token_rate": "1", "burst_tokens": 5}
        return apb.Tenant(**(base | kw))

    cases = [
        (bad(token_rate="0"), "token_rate"),
        (bad(token_rate="1.0001"), "token_rate"),
        (bad(burst_tokens=0), "burst_tokens"),
        (bad(hourly_quota=-1), "hourly_quota"),
        (bad(default_lane="gold"), "default_lane"),
        (bad(max_concurrency=2**40), "max_concurrency"),
        (bad(tenant_id=""), "tenant_id"),
    ]
    for tenant, field in cases:
        code, details = code_of(
            partial(env.admin.call, "CreateTenant", apb.CreateTenantRequest(tenant=tenant))
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        assert details.startswith(field), details
    assert [t.tenant_id for t in env.admin.list_tenants()] == ["acme", "beta", "gamma"]


def test_update_with_mask_clears_and_validates_without_half_applying(env: Env) -> None:
    before = env.tenant("acme")
    t = env.admin.call(
        "UpdateTenant",
        apb.UpdateTenantRequest(
            tenant=apb.Tenant(tenant_id="acme", burst_tokens=777, display_name="Acme"),
            update_mask=FieldMask(paths=["burst_tokens", "hourly_quota", "display_name"]),
        ),
    )
    assert (t.burst_tokens, t.display_name) == (777, "Acme")
    assert not t.HasField("hourly_quota")  # named and unset: unlimited now
    assert t.token_rate == before.token_rate and t.max_concurrency == 50
    n_audit = len(env.audit())
    acme = apb.Tenant(tenant_id="acme")
    bad_rate = apb.Tenant(tenant_id="acme", burst_tokens=5, token_rate="-1")
    cases: list[tuple[list[str], apb.Tenant, str]] = [
        ([], acme, "update_mask"),
        (["tenant_id"], acme, "update_mask"),
        # burst is valid, rate is not: nothing of the two may be applied
        (["burst_tokens", "token_rate"], bad_rate, "token_rate"),
        (["enabled"], acme, "enabled"),
        (["burst_tokens"], apb.Tenant(tenant_id="nobody", burst_tokens=5), "tenant_id"),
    ]
    for mask, tenant, field in cases:
        request = apb.UpdateTenantRequest(tenant=tenant, update_mask=FieldMask(paths=mask))
        code, details = code_of(partial(env.admin.call, "UpdateTenant", request))
        assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), details
        assert details.startswith(field), details
    assert env.tenant("acme").burst_tokens == 777
    assert len(env.audit()) == n_audit


def test_disable_enable_and_delete(env: Env) -> None:
    assert (
        env.admin.call("DisableTenant", apb.DisableTenantRequest(tenant_id="acme")).enabled is False
    )
    refused = env.admit("acme", "r1")
    assert refused.reason == pb.REASON_TENANT_DISABLED and "disabled" in refused.message
    env.admin.call("EnableTenant", apb.EnableTenantRequest(tenant_id="acme"))
    held = env.admit("acme", "r2")
    assert held.decision == pb.DECISION_ADMIT
    code, details = code_of(
        lambda: env.admin.call("DeleteTenant", apb.DeleteTenantRequest(tenant_id="acme"))
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "1 unsettled" in details
    assert env.tenant("acme").tenant_id == "acme"
    r = env.admin.call("DeleteTenant", apb.DeleteTenantRequest(tenant_id="acme", force=True))
    assert r.tenant.tenant_id == "acme" and r.open_reservations == 1
    assert env.admit("acme", "r3").reason == pb.REASON_UNKNOWN_TENANT
    # The reservation taken before the delete can still be settled.
    done = env.admission().Complete(
        pb.CompleteRequest(tenant_id="acme", request_id="r2", prompt_tokens=100)
    )
    assert done.actual_tokens == 100
    # A tenant without reservations is deleted without force.
    env.admin.call("DeleteTenant", apb.DeleteTenantRequest(tenant_id="beta"))
    assert env.admin.list_tenants() == []


def test_lanes(env: Env) -> None:
    lanes = env.viewer.call("ListLanes", apb.ListLanesRequest()).lanes
    assert [(x.name, x.weight, x.wait_target_ms) for x in lanes] == [
        ("premium", "0.4", 200), ("standard", "0.45", 800), ("batch", "0.15", 5000),
    ]  # fmt: skip
    lane = env.admin.call(
        "UpdateLane",
        apb.UpdateLaneRequest(
            lane=apb.Lane(name="batch", weight="0.2", wait_target_ms=9000),
            update_mask=FieldMask(paths=["weight", "wait_target_ms"]),
        ),
    )
    assert (lane.weight, lane.wait_target_ms, lane.priority) == ("0.2", 9000, 2)
    views = env.srv.plane.service.views
    assert env.srv.on_loop(lambda: views.lanes["batch"].wait_target_ms) == 9000
    code, details = code_of(
        lambda: env.admin.call(
            "UpdateLane",
            apb.UpdateLaneRequest(
                lane=apb.Lane(name="batch", weight="1.5"), update_mask=FieldMask(paths=["weight"])
            ),
        )
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("weight")
    code, details = code_of(
        lambda: env.admin.call(
            "UpdateLane",
            apb.UpdateLaneRequest(
                lane=apb.Lane(name="bulk", weight="0.1"), update_mask=FieldMask(paths=["weight"])
            ),
        )
    )
    assert code == grpc.StatusCode.NOT_FOUND
    created = env.admin.call(
        "UpdateLane",
        apb.UpdateLaneRequest(
            lane=apb.Lane(name="bulk", weight="0.05", wait_target_ms=60000, priority=3),
            update_mask=FieldMask(paths=["weight", "wait_target_ms", "priority"]),
            allow_missing=True,
        ),
    )
    assert created.name == "bulk"
    ok = env.admission().Admit(
        pb.AdmitRequest(tenant_id="acme", request_id="b1", lane="bulk", prompt_tokens=1)
    )
    assert ok.lane == "bulk"


def test_policy(env: Env) -> None:
    view = {s.key: s for s in env.viewer.call("GetPolicy", apb.GetPolicyRequest()).settings}
    assert json.loads(view["bp_hard_threshold"].value_json) == 0.85
    assert not any(s.overridden for s in view.values())
    updated = env.admin.call(
        "UpdatePolicy",
        apb.UpdatePolicyRequest(set={"bp_hard_threshold": "0.9", "stale_policy": "fail_closed"}),
    )
    got = {s.key: s for s in updated.settings}
    assert json.loads(got["bp_hard_threshold"].value_json) == 0.9
    assert json.loads(got["stale_policy"].value_json) == "fail_closed"
    assert got["bp_hard_threshold"].overridden
    assert env.srv.on_loop(lambda: env.srv.plane.service.policy.bp_hard_threshold) == 0.9
    bad: list[tuple[dict[str, str], str]] = [
        ({"bp_alpha": "0.5"}, "bp_alpha"),  # weights no longer sum to 1
        ({"bp_soft_threshold": "0.95"}, "bp_soft_threshold"),  # above hard
        ({"no_such_key": "1"}, "no_such_key"),
        ({"queue_limit": "-3"}, "queue_limit"),
    ]
    for set_, field in bad:
        code, details = code_of(
            partial(env.admin.call, "UpdatePolicy", apb.UpdatePolicyRequest(set=set_))
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        assert field in details, details
    assert env.srv.on_loop(lambda: env.srv.plane.service.policy.bp_alpha) == 0.4
    reset = env.admin.call("UpdatePolicy", apb.UpdatePolicyRequest(reset=["bp_hard_threshold"]))
    got = {s.key: s for s in reset.settings}
    assert json.loads(got["bp_hard_threshold"].value_json) == 0.85
    assert not got["bp_hard_threshold"].overridden and got["stale_policy"].overridden
    assert env.srv.on_loop(lambda: env.srv.plane.service.policy.bp_hard_threshold) == 0.85


def test_live_state(env: Env) -> None:
    for i in range(3):
        assert env.admit("acme", f"r{i}", prompt=1000).decision == pb.DECISION_ADMIT
    env.admission().Complete(
        pb.CompleteRequest(tenant_id="acme", request_id="r0", prompt_tokens=600)
    )
    # over twice its burst of 5,000: never fits
    assert env.admit("beta", "big", prompt=10_001).reason == pb.REASON_MAX_TOKENS
    s = env.viewer.call("GetTenantState", apb.GetTenantStateRequest(tenant_id="acme"))
    assert s.enabled and s.burst_tokens == 10_000
    assert 7_000 <= s.bucket_tokens <= 10_000
    assert s.hourly_used_tokens == 2600 and s.hourly_quota == 1_000_000
    assert s.daily_quota == -1
    assert (s.in_flight_requests, s.in_flight_tokens) == (2, 2000)
    env.admission().ReportLoad(
        pb.LoadReport(
            pool="a100", engine_id="e1", batch_tokens=500, max_batch_tokens=1000,
            queue_depth=20, queue_capacity=100, kv_cache_miss_rate=0.1, gpu_utilization=0.5,
        )
    )  # fmt: skip
    st = env.viewer.call("GetServerState", apb.GetServerStateRequest())
    counts = {(d.decision, d.reason): d.count for d in st.decisions}
    assert counts[(pb.DECISION_ADMIT, pb.REASON_UNSPECIFIED)] == 3
    assert counts[(pb.DECISION_REJECT, pb.REASON_MAX_TOKENS)] == 1
    assert st.tenants == 2 and st.open_reservations == 2 and st.config_reloads >= 1
    assert st.fastpath in ("cython", "python")
    # every declared pool is listed (its demand matters before any engine
    # reports: docs/autoscaling.md); one reported
    pools = {p.pool: p for p in st.pools}
    assert {"a100", "default"} <= set(pools)
    assert [p.pool for p in st.pools if p.engines_reporting] == ["a100"]
    pool = pools["a100"]
    assert pool.engines_reporting == 1
    assert 0 < pool.backpressure_score < 1 and pool.pricing_multiplier == "1.000000"
    code, _ = code_of(
        lambda: env.viewer.call("GetTenantState", apb.GetTenantStateRequest(tenant_id="nobody"))
    )
    assert code == grpc.StatusCode.NOT_FOUND


def test_api_keys_through_the_api(env: Env) -> None:
    created = env.admin.call("CreateApiKey", apb.CreateApiKeyRequest(name="ops-bob", role="viewer"))
    assert created.secret.startswith(f"bgk_{created.key.key_id}_")
    assert created.key.role == "viewer" and created.key.created_by.startswith("key:")
    bob = env.client(created.secret)
    assert [t.tenant_id for t in bob.list_tenants()] == ["acme", "beta"]
    listed = env.admin.call("ListApiKeys", apb.ListApiKeysRequest()).keys
    assert {k.name for k in listed} >= {"ops-bob", "test-admin", "test-viewer", "test-sidecar"}
    assert all("secret" not in k.DESCRIPTOR.fields_by_name for k in listed)
    revoked = env.admin.call("RevokeApiKey", apb.RevokeApiKeyRequest(key_id=created.key.key_id))
    assert revoked.HasField("revoke_time")
    code, _ = code_of(lambda: bob.list_tenants())
    assert code == grpc.StatusCode.UNAUTHENTICATED
    active = env.admin.call("ListApiKeys", apb.ListApiKeysRequest()).keys
    assert "ops-bob" not in {k.name for k in active}
    every = env.admin.call("ListApiKeys", apb.ListApiKeysRequest(include_revoked=True)).keys
    assert "ops-bob" in {k.name for k in every}
    code, details = code_of(
        lambda: env.admin.call("CreateApiKey", apb.CreateApiKeyRequest(name="x", role="root"))
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("role")
    code, _ = code_of(
        lambda: env.admin.call("RevokeApiKey", apb.RevokeApiKeyRequest(key_id="nope"))
    )
    assert code == grpc.StatusCode.NOT_FOUND
    bob.close()


def test_tenant_and_lane_pools(env: Env) -> None:
    def live_pool(tenant: str, rid: str) -> str:
        svc = env.srv.plane.service
        rec = env.srv.on_loop(lambda: svc.views.record(tenant, rid))
        assert rec is not None and rec.is_open
        pool: str = rec.pool
        return pool

    def update_tenant(t: apb.Tenant) -> apb.Tenant:
        req = apb.UpdateTenantRequest(tenant=t, update_mask=FieldMask(paths=["pool"]))
        out: apb.Tenant = env.admin.call("UpdateTenant", req)
        return out

    def update_lane(lane: apb.Lane) -> apb.Lane:
        req = apb.UpdateLaneRequest(lane=lane, update_mask=FieldMask(paths=["pool"]))
        out: apb.Lane = env.admin.call("UpdateLane", req)
        return out

    created = env.admin.call(
        "CreateTenant",
        apb.CreateTenantRequest(
            tenant=apb.Tenant(tenant_id="gamma", token_rate="1000", burst_tokens=10_000,
                              pool="gpu-a")
        ),
    )  # fmt: skip
    assert created.pool == "gpu-a" and env.tenant("gamma").pool == "gpu-a"
    assert not env.tenant("acme").HasField("pool")
    env.admit("gamma", "r1")  # names no pool: the tenant's, live at once
    assert live_pool("gamma", "r1") == "gpu-a"
    assert update_lane(apb.Lane(name="standard", pool="gpu-lane")).pool == "gpu-lane"
    assert {x.name: x.pool for x in env.viewer.call("ListLanes", apb.ListLanesRequest()).lanes}[
        "standard"
    ] == "gpu-lane"
    env.admit("gamma", "r2")  # the tenant's pool still comes first
    assert live_pool("gamma", "r2") == "gpu-a"
    # clearing: named in update_mask and unset, or set empty
    assert not update_tenant(apb.Tenant(tenant_id="gamma")).HasField("pool")
    assert not env.tenant("gamma").HasField("pool")
    env.admit("gamma", "r3")  # now its lane's
    assert live_pool("gamma", "r3") == "gpu-lane"
    assert update_tenant(apb.Tenant(tenant_id="gamma", pool="gpu-b")).pool == "gpu-b"
    assert not update_tenant(apb.Tenant(tenant_id="gamma", pool="")).HasField("pool")
    assert not update_lane(apb.Lane(name="standard")).HasField("pool")
    env.admit("gamma", "r4")  # neither: the default pool
    assert live_pool("gamma", "r4") == "default"
    audit = env.audit(target="tenant:gamma")
    assert any(json.loads(e.after_json or "{}").get("pool") == "gpu-b" for e in audit)
    # a bad pool name is refused naming the field, and nothing changes
    for bad in ("p" * 129, "gpu\na"):
        for call in (
            partial(env.admin.call, "CreateTenant", apb.CreateTenantRequest(
                tenant=apb.Tenant(tenant_id="delta", token_rate="1", burst_tokens=5, pool=bad))),
            partial(update_tenant, apb.Tenant(tenant_id="gamma", pool=bad)),
            partial(update_lane, apb.Lane(name="standard", pool=bad)),
        ):  # fmt: skip
            code, details = code_of(call)
            assert code == grpc.StatusCode.INVALID_ARGUMENT, details
            assert details.startswith("pool"), details
    assert not env.tenant("gamma").HasField("pool")
    assert "delta" not in [t.tenant_id for t in env.admin.list_tenants()]

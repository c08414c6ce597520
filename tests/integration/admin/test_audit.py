"""Audit records: who, when, what, before/after; listed newest first."""

from __future__ import annotations

import json
import time

from burstgate_client._proto.burstgate.v1 import admin_pb2 as apb
from google.protobuf.field_mask_pb2 import FieldMask

from tests.integration.admin.conftest import Env


def test_every_change_is_audited_with_before_and_after(env: Env) -> None:
    t0 = time.time()
    env.admin.call(
        "CreateTenant",
        apb.CreateTenantRequest(
            tenant=apb.Tenant(tenant_id="gamma", token_rate="5", burst_tokens=50)
        ),
    )
    env.admin.call(
        "UpdateTenant",
        apb.UpdateTenantRequest(
            tenant=apb.Tenant(tenant_id="gamma", token_rate="7.5", burst_tokens=50),
            update_mask=FieldMask(paths=["token_rate", "burst_tokens"]),  # burst unchanged
        ),
    )
    env.admin.call("DisableTenant", apb.DisableTenantRequest(tenant_id="gamma"))
    env.admin.call("UpdatePolicy", apb.UpdatePolicyRequest(set={"bp_hard_threshold": "0.9"}))
    env.admin.call(
        "UpdateLane",
        apb.UpdateLaneRequest(
            lane=apb.Lane(name="batch", wait_target_ms=6000),
            update_mask=FieldMask(paths=["wait_target_ms"]),
        ),
    )
    env.admin.call("DeleteTenant", apb.DeleteTenantRequest(tenant_id="gamma"))
    events = env.viewer.call("ListAuditEvents", apb.ListAuditEventsRequest()).events
    actions = [(e.action, e.target) for e in events]
    assert actions[:6] == [
        ("tenant.delete", "tenant:gamma"),
        ("lane.update", "lane:batch"),
        ("policy.update", "policy"),
        ("tenant.disable", "tenant:gamma"),
        ("tenant.update", "tenant:gamma"),
        ("tenant.create", "tenant:gamma"),
    ]
    # The key and tenant fixtures were created DB-direct, and audited as such
    # (the keys as "local:test", the tenants as the default local:<os user>).
    assert {e.action for e in events[6:]} == {"key.create", "tenant.create"}
    assert all(e.actor.startswith("local:") and e.actor_role == "local" for e in events[6:])
    by_action = {e.action: e for e in reversed(events[:6])}
    admin_id = env.keys.ids["admin"]
    for e in events[:6]:
        assert e.actor == f"key:{admin_id} (test-admin)" and e.actor_role == "admin"
        assert e.time.seconds >= int(t0) - 1 and e.request_id
    update = by_action["tenant.update"]
    assert json.loads(update.before_json) == {"token_rate": "5"}
    assert json.loads(update.after_json) == {"token_rate": "7.5"}
    created = by_action["tenant.create"]
    assert created.before_json == "" and json.loads(created.after_json)["burst_tokens"] == 50
    deleted = by_action["tenant.delete"]
    assert json.loads(deleted.before_json)["enabled"] is False and deleted.after_json == ""
    assert json.loads(by_action["tenant.disable"].after_json) == {"enabled": False}
    assert json.loads(by_action["policy.update"].before_json) == {"bp_hard_threshold": 0.85}
    assert json.loads(by_action["lane.update"].after_json)["wait_target_ms"] == 6000


def test_audit_filters_and_pages(env: Env) -> None:
    for burst in (100, 200, 300):
        env.admin.call(
            "UpdateTenant",
            apb.UpdateTenantRequest(
                tenant=apb.Tenant(tenant_id="acme", burst_tokens=burst),
                update_mask=FieldMask(paths=["burst_tokens"]),
            ),
        )
    env.admin.call("DisableTenant", apb.DisableTenantRequest(tenant_id="beta"))
    acme = env.audit(target="tenant:acme")
    # ... and the fixture's own tenant.create (DB-direct, audited too).
    assert [json.loads(e.after_json)["burst_tokens"] for e in acme] == [300, 200, 100, 10_000]
    assert acme[-1].action == "tenant.create" and acme[-1].actor.startswith("local:")
    assert [e.target for e in env.audit(action="tenant.disable")] == ["tenant:beta"]
    assert len(env.audit(actor=env.keys.ids["admin"])) == 4
    first = env.admin.call("ListAuditEvents", apb.ListAuditEventsRequest(page_size=2))
    second = env.admin.call(
        "ListAuditEvents",
        apb.ListAuditEventsRequest(page_size=2, page_token=first.next_page_token),
    )
    ids = [e.id for e in (*first.events, *second.events)]
    assert ids == sorted(ids, reverse=True) and len(set(ids)) == 4
    # A no-op update writes nothing.
    n = len(env.audit())
    env.admin.call(
        "UpdateTenant",
        apb.UpdateTenantRequest(
            tenant=apb.Tenant(tenant_id="acme", burst_tokens=300),
            update_mask=FieldMask(paths=["burst_tokens"]),
        ),
    )
    assert len(env.audit()) == n

"""protobuf <-> domain conversions of the admin servicer, and the policy
setting parser: no I/O."""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime
from decimal import Decimal

import pytest
from burstgate_client._proto.burstgate.v1 import admin_pb2 as apb

from controlplane.domain import LaneConfig, TenantConfig
from controlplane.domain.errors import InvalidArgument
from controlplane.domain.policy import Policy
from controlplane.rpc.admin_pb import (
    _field_value,
    decode_page_token,
    encode_page_token,
    json_value,
    lane_to_pb,
    mask_paths,
    policy_to_pb,
    tenant_changes,
    tenant_from_pb,
    tenant_to_pb,
)
from controlplane.store.audit import to_json
from controlplane.store.config import TenantRecord

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def test_tenant_round_trip_keeps_unset_limits_unlimited() -> None:
    cfg = TenantConfig(
        tenant_id="acme",
        token_rate=Decimal("12.5"),
        burst_tokens=1000,
        hourly_quota=5000,
        fallback_model="small",
        default_lane="batch",
        demote_long_requests=False,
    )
    msg = tenant_to_pb(TenantRecord(cfg, NOW, NOW))
    assert msg.token_rate == "12.5"
    assert msg.HasField("hourly_quota") and not msg.HasField("daily_quota")
    assert tenant_from_pb(msg) == cfg
    whole = tenant_to_pb(TenantRecord(TenantConfig("b", Decimal("2000.000"), 5), NOW, NOW))
    assert whole.token_rate == "2000"


def test_pool_round_trips_and_empty_means_not_configured() -> None:
    cfg = TenantConfig(tenant_id="acme", token_rate=Decimal(1), burst_tokens=10, pool="gpu-a")
    msg = tenant_to_pb(TenantRecord(cfg, NOW, NOW))
    assert msg.pool == "gpu-a" and tenant_from_pb(msg) == cfg
    unset = tenant_to_pb(TenantRecord(dataclasses.replace(cfg, pool=None), NOW, NOW))
    assert not unset.HasField("pool")
    # named in update_mask: unset or empty both clear it
    assert tenant_changes(apb.Tenant(), ["pool"]) == {"pool": None}
    assert tenant_changes(apb.Tenant(pool=""), ["pool"]) == {"pool": None}
    assert tenant_changes(apb.Tenant(pool="gpu-b"), ["pool"]) == {"pool": "gpu-b"}
    lane = lane_to_pb(LaneConfig("bulk", 3, Decimal("0.05"), 1, False, True, pool="gpu-c"))
    assert lane.pool == "gpu-c"
    assert not lane_to_pb(LaneConfig("bulk", 3, Decimal("0.05"), 1, False, True)).HasField("pool")


def test_create_defaults_and_field_errors() -> None:
    cfg = tenant_from_pb(apb.Tenant(tenant_id="x", token_rate="5", burst_tokens=10))
    assert cfg.enabled and cfg.demote_long_requests and cfg.default_lane == "standard"
    with pytest.raises(InvalidArgument, match=r"^token_rate"):
        tenant_from_pb(apb.Tenant(tenant_id="x", burst_tokens=10))
    with pytest.raises(InvalidArgument, match=r"^token_rate: not a decimal"):
        tenant_from_pb(apb.Tenant(tenant_id="x", token_rate="fast", burst_tokens=10))
    with pytest.raises(InvalidArgument, match=r"^enabled"):
        _field_value(apb.Tenant(), "enabled")
    assert _field_value(apb.Tenant(), "hourly_quota") is None  # named + unset = unlimited


def test_update_mask_is_required_and_checked() -> None:
    allowed = frozenset({"burst_tokens", "token_rate"})
    with pytest.raises(InvalidArgument, match=r"^update_mask: required"):
        mask_paths([], allowed, "Tenant")
    with pytest.raises(InvalidArgument, match="'tenant_id' cannot be changed"):
        mask_paths(["tenant_id"], allowed, "Tenant")
    assert mask_paths(["burst_tokens", "burst_tokens"], allowed, "Tenant") == ["burst_tokens"]


def test_policy_values_and_view() -> None:
    assert json_value("k", "0.9") == 0.9
    assert json_value("k", "true") is True
    assert json_value("k", "fail_closed") == "fail_closed"
    with pytest.raises(InvalidArgument, match=r"^set\[k\]: not a JSON value"):
        json_value("k", "{oops")
    view = policy_to_pb(Policy(), {"bp_hard_threshold": 0.9})
    by_key = {s.key: s for s in view.settings}
    assert json.loads(by_key["bp_hard_threshold"].value_json) == 0.9
    assert json.loads(by_key["bp_hard_threshold"].default_json) == 0.85
    assert by_key["bp_hard_threshold"].overridden and not by_key["bp_alpha"].overridden


def test_page_tokens_and_audit_json() -> None:
    assert decode_page_token(encode_page_token("acme")) == "acme"
    with pytest.raises(InvalidArgument, match=r"^page_token"):
        decode_page_token("%%%")
    assert to_json({"token_rate": Decimal("1.5"), "at": NOW}) == (
        '{"at": "2026-11-29T12:00:00+00:00", "token_rate": "1.5"}'
    )
    assert to_json(None) is None

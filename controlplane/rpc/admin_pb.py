"""AdminService messages: protobuf <-> domain conversions, update masks and
page tokens, shared by the servicer and the tenant CLI (which prints what
the API would answer, whichever way it reached its target)."""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from typing import Any

from burstgate_client._proto.burstgate.v1 import admin_pb2 as apb
from google.protobuf.timestamp_pb2 import Timestamp

from controlplane.domain import LaneConfig, TenantConfig
from controlplane.domain.audit import AuditRecord
from controlplane.domain.errors import InvalidArgument, excerpt
from controlplane.domain.keys import KeyInfo
from controlplane.domain.policy import Policy, effective_policy
from controlplane.domain.validate import POSITIVE_LIMITS
from controlplane.store.audit import decimal_text
from controlplane.store.config import TENANT_FIELDS, TenantRecord

# Tenant fields that UpdateTenant may name in update_mask.
TENANT_MASK_FIELDS = frozenset(TENANT_FIELDS)
# Optional integer fields of the Tenant message (unset = unlimited / default).
OPTIONAL_INT_FIELDS = (*POSITIVE_LIMITS, "max_wait_ms")
LANE_MASK_FIELDS = frozenset(
    {"priority", "weight", "wait_target_ms", "fail_open", "degradable", "max_queued", "pool"}
)

DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000


def encode_page_token(value: str) -> str:
    return base64.urlsafe_b64encode(value.encode()).decode()


def decode_page_token(token: str) -> str:
    try:
        value = base64.b64decode(token.encode(), altchars=b"-_", validate=True).decode()
    except (ValueError, UnicodeDecodeError):
        value = "\0"
    # Tokens this API returns hold an id or a number: printable text (a NUL
    # would reach the database, which refuses it inside text).
    if not value.isprintable():
        raise InvalidArgument("page_token", "not a token returned by this API")
    return value


def page_size(requested: int) -> int:
    if requested < 0:
        raise InvalidArgument("page_size", f"must be >= 0, got {requested}")
    return min(requested or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)


# ------------------------------------------------------------ conversions


def _ts(dt: datetime | None) -> Timestamp | None:
    if dt is None:
        return None
    ts = Timestamp()
    ts.FromDatetime(dt)
    return ts


def parse_decimal(field: str, text: str) -> Decimal:
    try:
        value = Decimal(text.strip())
    except InvalidOperation:
        raise InvalidArgument(field, f"not a decimal number: {excerpt(text)}") from None
    if not value.is_finite():
        raise InvalidArgument(field, f"not a finite number: {excerpt(text)}")
    return value


def tenant_to_pb(rec: TenantRecord) -> apb.Tenant:
    c = rec.config
    t = apb.Tenant(
        tenant_id=c.tenant_id,
        display_name=c.display_name,
        enabled=c.enabled,
        token_rate=decimal_text(c.token_rate),
        burst_tokens=c.burst_tokens,
        default_lane=c.default_lane,
        shadow_mode=c.shadow_mode,
        demote_long_requests=c.demote_long_requests,
        create_time=_ts(rec.created_at),
        update_time=_ts(rec.updated_at),
    )
    for name in OPTIONAL_INT_FIELDS:
        value = getattr(c, name)
        if value is not None:
            setattr(t, name, value)
    if c.fallback_model is not None:
        t.fallback_model = c.fallback_model
    if c.pool is not None:
        t.pool = c.pool
    return t


def optional_pool(msg: apb.Tenant | apb.Lane) -> str | None:
    """A Tenant's or Lane's configured pool as sent: unset and empty both
    mean none (an empty pool is no pool), so either clears it."""
    return msg.pool or None


def _field_value(t: apb.Tenant, name: str) -> Any:
    """The domain value of one Tenant field as sent (None = unset optional)."""
    if name == "token_rate":
        return parse_decimal("token_rate", t.token_rate)
    if name == "pool":
        return optional_pool(t)
    msg: Any = t  # HasField is typed with literal field names
    if name in OPTIONAL_INT_FIELDS or name == "fallback_model":
        return getattr(t, name) if msg.HasField(name) else None
    if name in ("enabled", "demote_long_requests"):
        if not msg.HasField(name):
            raise InvalidArgument(name, "must be set (true or false) when named in update_mask")
        return getattr(t, name)
    return getattr(t, name)


def tenant_changes(t: apb.Tenant, paths: list[str]) -> dict[str, Any]:
    """UpdateTenant's changes: field -> domain value for the masked fields."""
    return {p: _field_value(t, p) for p in mask_paths(paths, TENANT_MASK_FIELDS, "Tenant")}


def tenant_from_pb(t: apb.Tenant) -> TenantConfig:
    if not t.token_rate:
        raise InvalidArgument("token_rate", "required (tokens/s)")
    values = {
        name: _field_value(t, name)
        for name in TENANT_FIELDS
        if name not in ("enabled", "demote_long_requests")
    }
    values["default_lane"] = t.default_lane or "standard"
    values["enabled"] = t.enabled if t.HasField("enabled") else True
    values["demote_long_requests"] = (
        t.demote_long_requests if t.HasField("demote_long_requests") else True
    )
    return TenantConfig(tenant_id=t.tenant_id, **values)


def lane_to_pb(lane: LaneConfig) -> apb.Lane:
    msg = apb.Lane(
        name=lane.name,
        priority=lane.priority,
        weight=decimal_text(lane.weight),
        wait_target_ms=lane.wait_target_ms,
        fail_open=lane.fail_open,
        degradable=lane.degradable,
    )
    if lane.max_queued is not None:
        msg.max_queued = lane.max_queued
    if lane.pool is not None:
        msg.pool = lane.pool
    return msg


def key_to_pb(info: KeyInfo) -> apb.ApiKey:
    return apb.ApiKey(
        key_id=info.key_id,
        name=info.name,
        role=info.role.value,
        created_by=info.created_by,
        create_time=_ts(info.created_at),
        revoke_time=_ts(info.revoked_at),
        tenants=info.tenants,
        pools=info.pools,
        expire_time=_ts(info.expires_at),
        last_used_time=_ts(info.last_used_at),
    )


def parse_timestamp(field: str, ts: Timestamp) -> datetime:
    """A request's Timestamp as an aware UTC datetime; one out of
    Timestamp's own range (years 1-9999) is INVALID_ARGUMENT."""
    try:
        return ts.ToDatetime(tzinfo=UTC)
    except (ValueError, OverflowError):
        raise InvalidArgument(field, "is not a valid timestamp (years 1 to 9999)") from None


def audit_to_pb(a: AuditRecord) -> apb.AuditEvent:
    return apb.AuditEvent(
        id=a.id,
        time=_ts(a.at),
        actor=a.actor,
        actor_role=a.actor_role,
        action=a.action,
        target=a.target,
        before_json=a.before or "",
        after_json=a.after or "",
        request_id=a.request_id,
    )


def policy_to_pb(base: Policy, overrides: dict[str, Any]) -> apb.Policy:
    effective = effective_policy(base, overrides).model_dump()
    defaults = base.model_dump()
    return apb.Policy(
        settings=[
            apb.PolicySetting(
                key=key,
                value_json=json.dumps(effective[key]),
                default_json=json.dumps(defaults[key]),
                overridden=key in overrides,
            )
            for key in sorted(effective)
        ]
    )


def json_value(key: str, text: str) -> Any:
    """A policy value of UpdatePolicyRequest.set: JSON, or a bare word taken
    as a string (fail_closed). Its type is checked against the key's by the
    store (``typed_value``); errors name the field ``set[<key>]``."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nested too deep
        if text and text.replace("_", "").isalnum():
            return text
        raise InvalidArgument(f"set[{key}]", f"not a JSON value: {excerpt(text)}") from None


def mask_paths(paths: list[str], allowed: frozenset[str], what: str) -> list[str]:
    if not paths:
        raise InvalidArgument("update_mask", f"required: name the {what} fields to change")
    for p in paths:
        if p not in allowed:
            raise InvalidArgument(
                "update_mask",
                f"{excerpt(p)} cannot be changed; one of {', '.join(sorted(allowed))}",
            )
    return list(dict.fromkeys(paths))


# --------------------------------------------------------------- servicer

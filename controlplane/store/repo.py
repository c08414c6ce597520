"""Config repository: tenants and lanes between the database and the domain."""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import Engine, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from controlplane.domain import LaneConfig, TenantConfig
from controlplane.domain.errors import AlreadyExists, NotFound
from controlplane.domain.policy import Policy, effective_policy
from controlplane.domain.validate import check_lane, check_tenant
from controlplane.store.models import Lane, PolicyOverride, Tenant

# TenantConfig fields that map 1:1 onto Tenant columns.
TENANT_FIELDS = (
    "display_name",
    "enabled",
    "token_rate",
    "burst_tokens",
    "hourly_quota",
    "daily_quota",
    "max_concurrency",
    "max_queued",
    "max_tokens_per_request",
    "default_lane",
    "shadow_mode",
    "dedicated_quota",
    "fallback_model",
    "max_wait_ms",
    "long_request_tokens",
    "demote_long_requests",
)
LANE_FIELDS = ("priority", "weight", "wait_target_ms", "fail_open", "degradable", "max_queued")
def tenant_to_domain(row: Tenant) -> TenantConfig:
    return TenantConfig(tenant_id=row.tenant_id, **{f: getattr(row, f) for f in TENANT_FIELDS})


def lane_to_domain(row: Lane) -> LaneConfig:
    return LaneConfig(name=row.name, **{f: getattr(row, f) for f in LANE_FIELDS})


class ConfigRepository:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def lanes(self) -> list[LaneConfig]:
        with Session(self.engine) as s:
            rows = s.scalars(select(Lane).order_by(Lane.priority, Lane.name)).all()
            return [lane_to_domain(r) for r in rows]

    def tenants(self) -> list[TenantConfig]:
        with Session(self.engine) as s:
            rows = s.scalars(select(Tenant).order_by(Tenant.tenant_id)).all()
            return [tenant_to_domain(r) for r in rows]

    def get_tenant(self, tenant_id: str) -> TenantConfig:
        with Session(self.engine) as s:
            row = s.scalar(select(Tenant).where(Tenant.tenant_id == tenant_id))
            if row is None:
                raise NotFound("tenant_id", f"unknown tenant {tenant_id!r}")
            return tenant_to_domain(row)

    def fingerprint(self) -> tuple[Any, ...]:
        """Cheap change detector the server polls: row counts and newest
        update time of the config tables."""
        with Session(self.engine) as s:
            t = s.execute(select(func.count(Tenant.id), func.max(Tenant.updated_at))).one()
            la = s.execute(select(func.count(Lane.name), func.max(Lane.updated_at))).one()
            po = s.execute(
                select(func.count(PolicyOverride.key), func.max(PolicyOverride.updated_at))
            ).one()
            return (*t, *la, *po)

    def add_tenant(self, cfg: TenantConfig) -> TenantConfig:
        check_tenant(cfg, (lane.name for lane in self.lanes()))
        with Session(self.engine) as s:
            s.add(Tenant(tenant_id=cfg.tenant_id, **{f: getattr(cfg, f) for f in TENANT_FIELDS}))
            try:
                s.commit()
            except IntegrityError as exc:
                raise AlreadyExists(f"tenant_id: tenant {cfg.tenant_id!r} already exists") from exc
        return cfg

    def upsert_tenant(self, cfg: TenantConfig) -> bool:
        """Create or replace a tenant's limits; True when it was created."""
        check_tenant(cfg, (lane.name for lane in self.lanes()))
        with Session(self.engine) as s:
            row = s.scalar(select(Tenant).where(Tenant.tenant_id == cfg.tenant_id))
            created = row is None
            if row is None:
                row = Tenant(tenant_id=cfg.tenant_id)
                s.add(row)
            for f in TENANT_FIELDS:
                setattr(row, f, getattr(cfg, f))
            s.commit()
            return created

    def set_enabled(self, tenant_id: str, enabled: bool) -> None:
        with Session(self.engine) as s:
            row = s.scalar(select(Tenant).where(Tenant.tenant_id == tenant_id))
            if row is None:
                raise NotFound("tenant_id", f"unknown tenant {tenant_id!r}")
            row.enabled = enabled
            s.commit()

    def upsert_lane(self, lane: LaneConfig) -> None:
        check_lane(lane)
        with Session(self.engine) as s:
            row = s.get(Lane, lane.name)
            if row is None:
                row = Lane(name=lane.name)
                s.add(row)
            for f in LANE_FIELDS:
                setattr(row, f, getattr(lane, f))
            s.commit()

    def policy_overrides(self) -> dict[str, Any]:
        with Session(self.engine) as s:
            return {r.key: json.loads(r.value) for r in s.scalars(select(PolicyOverride))}

    def set_policy_overrides(self, base: Policy, changes: dict[str, Any]) -> Policy:
        """Apply ``changes`` (a value of None removes the override) after
        validating the resulting policy as a whole; returns it."""
        with Session(self.engine) as s:
            current = {r.key: json.loads(r.value) for r in s.scalars(select(PolicyOverride))}
            merged = {k: v for k, v in (current | changes).items() if v is not None}
            policy = effective_policy(base, merged)
            for key, value in changes.items():
                row = s.get(PolicyOverride, key)
                if value is None:
                    if row is not None:
                        s.delete(row)
                elif row is None:
                    s.add(PolicyOverride(key=key, value=json.dumps(value)))
                else:
                    row.value = json.dumps(value)
            s.commit()
            return policy

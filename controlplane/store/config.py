"""The config repository: tenants, lanes and policy overrides, between the
database and the domain. The one place that writes these tables.

Every write validates first (``controlplane.domain.validate``:
``InvalidArgument`` naming the field), then writes the change *and* its
audit record in the same transaction: a change is either applied and
audited, or neither. ``actor`` is who the audit log names; it defaults to
``local:<os user>`` for in-process callers (the CLI's database-direct path,
``config apply``, the demo, tests and benchmarks); the admin API passes the
calling key. All methods block (SQLAlchemy); async callers run them in a
thread.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import structlog
from sqlalchemy import Engine, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from controlplane.domain import LaneConfig, TenantConfig
from controlplane.domain.audit import Actor
from controlplane.domain.errors import (
    MAX_ECHO_CHARS,
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    excerpt,
)
from controlplane.domain.policy import POLICY_KEYS, Policy, effective_policy, typed_value
from controlplane.domain.validate import check_lane, check_tenant
from controlplane.store.audit import aware, local_actor, log_change
from controlplane.store.models import Lane, PolicyOverride, Tenant

log = structlog.get_logger("burstgate.store")

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
    "pool",
)
LANE_FIELDS = (
    "priority", "weight", "wait_target_ms", "fail_open", "degradable", "max_queued", "pool",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class TenantRecord:
    config: TenantConfig
    created_at: datetime
    updated_at: datetime


def tenant_to_domain(row: Tenant) -> TenantConfig:
    return TenantConfig(tenant_id=row.tenant_id, **{f: getattr(row, f) for f in TENANT_FIELDS})


def lane_to_domain(row: Lane) -> LaneConfig:
    return LaneConfig(name=row.name, **{f: getattr(row, f) for f in LANE_FIELDS})


def tenant_dict(cfg: TenantConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def _record(row: Tenant) -> TenantRecord:
    return TenantRecord(tenant_to_domain(row), aware(row.created_at), aware(row.updated_at))


def _no_guard(cfg: TenantConfig) -> None:
    return None


class ConfigRepository:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @contextmanager
    def _tx(self) -> Iterator[Session]:
        with Session(self.engine) as s, s.begin():
            yield s

    @staticmethod
    def _lane_names(s: Session) -> list[str]:
        return list(s.scalars(select(Lane.name)))

    @staticmethod
    def _tenant_row(s: Session, tenant_id: str) -> Tenant:
        row = s.scalar(select(Tenant).where(Tenant.tenant_id == tenant_id))
        if row is None:
            raise NotFound("tenant_id", f"unknown tenant {excerpt(tenant_id)}")
        return row

    # -------------------------------------------------------------- reads

    def lanes(self) -> list[LaneConfig]:
        with Session(self.engine) as s:
            rows = s.scalars(select(Lane).order_by(Lane.priority, Lane.name)).all()
            return [lane_to_domain(r) for r in rows]

    def tenants(self) -> list[TenantConfig]:
        with Session(self.engine) as s:
            rows = s.scalars(select(Tenant).order_by(Tenant.tenant_id)).all()
            return [tenant_to_domain(r) for r in rows]

    def get_tenant(self, tenant_id: str) -> TenantRecord:
        with Session(self.engine) as s:
            return _record(self._tenant_row(s, tenant_id))

    def list_tenants(self, limit: int, after: str = "") -> tuple[list[TenantRecord], str]:
        """A page of tenants by id; the second value is the last id when more follow."""
        with Session(self.engine) as s:
            q = select(Tenant).order_by(Tenant.tenant_id).limit(limit + 1)
            if after:
                q = q.where(Tenant.tenant_id > after)
            rows = list(s.scalars(q))
        more = len(rows) > limit
        page = [_record(r) for r in rows[:limit]]
        return page, (page[-1].config.tenant_id if more and page else "")

    def policy_overrides(self) -> dict[str, Any]:
        with Session(self.engine) as s:
            return {r.key: json.loads(r.value) for r in s.scalars(select(PolicyOverride))}

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

    # ------------------------------------------------------------ tenants

    def add_tenant(self, cfg: TenantConfig, actor: Actor | None = None) -> TenantRecord:
        """Create a tenant; AlreadyExists if the id is taken."""
        actor = actor or local_actor()
        try:
            with self._tx() as s:
                check_tenant(cfg, self._lane_names(s))
                if s.scalar(select(Tenant.id).where(Tenant.tenant_id == cfg.tenant_id)):
                    raise AlreadyExists(
                        f"tenant_id: tenant {excerpt(cfg.tenant_id)} already exists"
                    )
                row = Tenant(tenant_id=cfg.tenant_id, **{f: getattr(cfg, f) for f in TENANT_FIELDS})
                s.add(row)
                log_change(
                    s, actor, "tenant.create", f"tenant:{cfg.tenant_id}", None, tenant_dict(cfg)
                )
                s.flush()
                record = _record(row)
        except IntegrityError as exc:  # lost a race with another creator
            raise AlreadyExists(
                f"tenant_id: tenant {excerpt(cfg.tenant_id)} already exists"
            ) from exc
        return record

    def update_tenant(
        self,
        tenant_id: str,
        changes: Mapping[str, Any],
        actor: Actor | None = None,
        action: str = "tenant.update",
    ) -> TenantRecord:
        """Apply ``changes`` (TenantConfig field -> value) to a tenant, validated as a whole."""
        actor = actor or local_actor()
        unknown = set(changes) - set(TENANT_FIELDS)
        if unknown:
            raise InvalidArgument(sorted(unknown)[0], "not a tenant field that can be changed")
        with self._tx() as s:
            row = self._tenant_row(s, tenant_id)
            before = tenant_to_domain(row)
            after = dataclasses.replace(before, **changes)
            check_tenant(after, self._lane_names(s))
            if after != before:
                for f in changes:
                    setattr(row, f, getattr(after, f))
                old, new = tenant_dict(before), tenant_dict(after)
                diff = [k for k in old if old[k] != new[k]]
                log_change(
                    s, actor, action, f"tenant:{tenant_id}",
                    {k: old[k] for k in diff}, {k: new[k] for k in diff},
                )  # fmt: skip
            s.flush()
            return _record(row)

    def set_enabled(
        self, tenant_id: str, enabled: bool, actor: Actor | None = None
    ) -> TenantRecord:
        action = "tenant.enable" if enabled else "tenant.disable"
        return self.update_tenant(tenant_id, {"enabled": enabled}, actor, action)

    def upsert_tenant(self, cfg: TenantConfig, actor: Actor | None = None) -> bool:
        """Create a tenant or replace all its settings (declarative config);
        True when it was created."""
        changes = {f: getattr(cfg, f) for f in TENANT_FIELDS}
        with Session(self.engine) as s:
            exists = s.scalar(select(Tenant.id).where(Tenant.tenant_id == cfg.tenant_id))
        if exists is None:
            try:
                self.add_tenant(cfg, actor)
                return True
            except AlreadyExists:  # created meanwhile: replace it below
                pass
        self.update_tenant(cfg.tenant_id, changes, actor)
        return False

    def delete_tenant(
        self,
        tenant_id: str,
        actor: Actor | None = None,
        guard: Callable[[TenantConfig], None] = _no_guard,
    ) -> TenantRecord:
        """Delete a tenant; ``guard`` raises FailedPrecondition to refuse."""
        actor = actor or local_actor()
        try:
            with self._tx() as s:
                row = self._tenant_row(s, tenant_id)
                record = _record(row)
                guard(record.config)
                s.delete(row)
                log_change(
                    s, actor, "tenant.delete", f"tenant:{tenant_id}",
                    tenant_dict(record.config), None,
                )  # fmt: skip
        except IntegrityError as exc:  # rows elsewhere still reference the tenant
            # The driver's text (constraint and table names) is for the log.
            log.warning("tenant delete refused by the database", error=str(exc.orig))
            raise FailedPrecondition(
                f"tenant_id: tenant {excerpt(tenant_id)} is still referenced by other rows"
            ) from exc
        return record

    # -------------------------------------------------------------- lanes

    def update_lane(
        self,
        name: str,
        changes: Mapping[str, Any],
        actor: Actor | None = None,
        *,
        allow_missing: bool = False,
    ) -> LaneConfig:
        actor = actor or local_actor()
        unknown = set(changes) - set(LANE_FIELDS)
        if unknown:
            raise InvalidArgument(sorted(unknown)[0], "not a lane field that can be changed")
        with self._tx() as s:
            row = s.get(Lane, name)
            if row is None:
                if not allow_missing:
                    raise NotFound("name", f"unknown lane {excerpt(name)}")
                missing = {"priority", "weight", "wait_target_ms"} - set(changes)
                if missing:
                    raise InvalidArgument(sorted(missing)[0], "required to create a lane")
                before = None
                after = LaneConfig(
                    name=name,
                    priority=changes["priority"],
                    weight=changes["weight"],
                    wait_target_ms=changes["wait_target_ms"],
                    fail_open=changes.get("fail_open", False),
                    degradable=changes.get("degradable", True),
                    max_queued=changes.get("max_queued"),
                    pool=changes.get("pool"),
                )
                row = Lane(name=name)
                s.add(row)
            else:
                before = lane_to_domain(row)
                after = dataclasses.replace(before, **changes)
            check_lane(after)
            if after != before:
                for f in LANE_FIELDS:
                    setattr(row, f, getattr(after, f))
                action = "lane.create" if before is None else "lane.update"
                old = None if before is None else dataclasses.asdict(before)
                log_change(s, actor, action, f"lane:{name}", old, dataclasses.asdict(after))
            return after

    def upsert_lane(self, lane: LaneConfig, actor: Actor | None = None) -> LaneConfig:
        """Create a lane or replace all its settings (declarative config)."""
        changes = {f: getattr(lane, f) for f in LANE_FIELDS}
        return self.update_lane(lane.name, changes, actor, allow_missing=True)

    # ------------------------------------------------------------- policy

    def update_policy(
        self,
        base: Policy,
        set_: Mapping[str, Any],
        reset: list[str],
        actor: Actor | None = None,
    ) -> tuple[Policy, dict[str, Any]]:
        """Set and/or reset policy keys, validated as a whole (e.g. the
        backpressure weights must still sum to 1). Each value set must be of
        its key's type, strictly (``typed_value``: no ``"true"`` for an
        integer). Errors name the key as ``set[<key>]`` / ``reset[<key>]``;
        nothing is stored. Returns the effective policy and the overrides
        now stored."""
        actor = actor or local_actor()
        for name, keys in (("set", list(set_)), ("reset", reset)):
            for key in keys:
                if key not in POLICY_KEYS:
                    shown = (
                        key if key.isprintable() and len(key) <= MAX_ECHO_CHARS else excerpt(key)
                    )
                    raise InvalidArgument(f"{name}[{shown}]", "unknown policy key")
        both = set(set_) & set(reset)
        if both:
            raise InvalidArgument(f"set[{sorted(both)[0]}]", "both set and reset")
        typed = {key: typed_value(key, value, f"set[{key}]") for key, value in set_.items()}
        with self._tx() as s:
            rows = {r.key: r for r in s.scalars(select(PolicyOverride))}
            current = {k: json.loads(r.value) for k, r in rows.items()}
            merged = {k: v for k, v in (current | typed).items() if k not in reset}
            old_policy = effective_policy(base, current)
            try:
                new_policy = effective_policy(base, merged)
            except InvalidArgument as exc:  # a bound: name the key as it was sent
                key, dot, rest = exc.field.partition(".")
                if key not in typed:
                    raise
                raise InvalidArgument(f"set[{key}]{dot}{rest}", exc.description) from exc
            new_values = new_policy.model_dump()
            changed = [k for k in (*set_, *reset) if k in merged or k in current]
            for key in set_:
                stored = json.dumps(new_values[key])  # normalised by pydantic (0.9, not "0.9")
                if key in rows:
                    rows[key].value = stored
                else:
                    s.add(PolicyOverride(key=key, value=stored))
            for key in reset:
                if key in rows:
                    s.delete(rows[key])
            old_values = old_policy.model_dump()
            log_change(
                s, actor, "policy.update", "policy",
                {k: old_values[k] for k in changed}, {k: new_values[k] for k in changed},
            )  # fmt: skip
            stored_now = {k: new_values[k] for k in merged}
        return new_policy, stored_now

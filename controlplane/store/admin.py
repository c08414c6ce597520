"""Admin writes and the audit log, one transaction each.

Every change validates first (``InvalidArgument`` naming the field), then
writes the change *and* its audit record in the same transaction: a change
is either applied and audited, or neither. Reads go through the same
models. All methods block (SQLAlchemy); the servicer runs them in a thread.
"""

from __future__ import annotations

import base64
import dataclasses
import json
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import Engine, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from controlplane.domain import LaneConfig, TenantConfig
from controlplane.domain.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from controlplane.domain.keys import KeyInfo, Role
from controlplane.domain.policy import POLICY_KEYS, Policy, effective_policy
from controlplane.domain.validate import check_lane, check_tenant
from controlplane.store.keys import KeyStore
from controlplane.store.models import AuditEvent, Lane, PolicyOverride, Tenant
from controlplane.store.repo import LANE_FIELDS, TENANT_FIELDS, lane_to_domain

DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000


@dataclass(frozen=True, slots=True)
class Actor:
    """Who makes a change, as written to the audit log."""

    name: str  # "key:<key_id> (<key name>)" or "local:<os user>"
    role: str
    request_id: str = ""


@dataclass(frozen=True, slots=True)
class TenantRecord:
    config: TenantConfig
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True, slots=True)
class AuditRecord:
    id: int
    at: datetime
    actor: str
    actor_role: str
    action: str
    target: str
    before: str | None
    after: str | None
    request_id: str


def aware(dt: datetime) -> datetime:
    """SQLite hands back naive datetimes; everything we store is UTC."""
    return dt if dt.tzinfo is not None else dt.replace(tzinfo=UTC)


def decimal_text(value: Decimal) -> str:
    """2000.000 -> "2000", 12.500 -> "12.5" (never exponent notation)."""
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def _jsonable(value: Any) -> Any:
    if isinstance(value, Decimal):
        return decimal_text(value)
    if isinstance(value, datetime):
        return aware(value).isoformat()
    return value


def to_json(obj: Mapping[str, Any] | None) -> str | None:
    if obj is None:
        return None
    return json.dumps({k: _jsonable(v) for k, v in obj.items()}, sort_keys=True)


def tenant_dict(cfg: TenantConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def key_dict(info: KeyInfo) -> dict[str, Any]:
    return {
        "key_id": info.key_id,
        "name": info.name,
        "role": info.role.value,
        "created_by": info.created_by,
        "revoked_at": info.revoked_at,
    }


def encode_page_token(value: str) -> str:
    return base64.urlsafe_b64encode(value.encode()).decode()


def decode_page_token(token: str) -> str:
    try:
        return base64.b64decode(token.encode(), altchars=b"-_", validate=True).decode()
    except (ValueError, UnicodeDecodeError):
        raise InvalidArgument("page_token", "not a token returned by this API") from None


def page_size(requested: int) -> int:
    if requested < 0:
        raise InvalidArgument("page_size", f"must be >= 0, got {requested}")
    return min(requested or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)


def _record(row: Tenant) -> TenantRecord:
    cfg = TenantConfig(tenant_id=row.tenant_id, **{f: getattr(row, f) for f in TENANT_FIELDS})
    return TenantRecord(cfg, aware(row.created_at), aware(row.updated_at))


def _audit(row: AuditEvent) -> AuditRecord:
    return AuditRecord(
        row.id, aware(row.at), row.actor, row.actor_role, row.action, row.target,
        row.before, row.after, row.request_id,
    )  # fmt: skip


class AdminStore:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @contextmanager
    def _tx(self) -> Iterator[Session]:
        with Session(self.engine) as s, s.begin():
            yield s

    @staticmethod
    def log_change(
        s: Session,
        actor: Actor,
        action: str,
        target: str,
        before: Mapping[str, Any] | None,
        after: Mapping[str, Any] | None,
    ) -> None:
        """Add an audit record to the session ``s`` (the caller's transaction,
        so the change and its record commit together). Other packages'
        operator RPCs call this with ``interceptor.current_actor()``."""
        s.add(
            AuditEvent(
                actor=actor.name[:256],
                actor_role=actor.role,
                action=action,
                target=target[:256],
                before=to_json(before),
                after=to_json(after),
                request_id=actor.request_id[:128],
            )
        )

    @staticmethod
    def _lane_names(s: Session) -> list[str]:
        return list(s.scalars(select(Lane.name)))

    @staticmethod
    def _tenant_row(s: Session, tenant_id: str) -> Tenant:
        row = s.scalar(select(Tenant).where(Tenant.tenant_id == tenant_id))
        if row is None:
            raise NotFound("tenant_id", f"unknown tenant {tenant_id!r}")
        return row

    # ------------------------------------------------------------ tenants

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

    def create_tenant(self, cfg: TenantConfig, actor: Actor) -> TenantRecord:
        try:
            with self._tx() as s:
                check_tenant(cfg, self._lane_names(s))
                if s.scalar(select(Tenant.id).where(Tenant.tenant_id == cfg.tenant_id)):
                    raise AlreadyExists(f"tenant_id: tenant {cfg.tenant_id!r} already exists")
                row = Tenant(tenant_id=cfg.tenant_id, **{f: getattr(cfg, f) for f in TENANT_FIELDS})
                s.add(row)
                self.log_change(
                    s, actor, "tenant.create", f"tenant:{cfg.tenant_id}", None, tenant_dict(cfg)
                )
                s.flush()
                record = _record(row)
        except IntegrityError as exc:  # lost a race with another creator
            raise AlreadyExists(f"tenant_id: tenant {cfg.tenant_id!r} already exists") from exc
        return record

    def update_tenant(
        self,
        tenant_id: str,
        changes: Mapping[str, Any],
        actor: Actor,
        action: str = "tenant.update",
    ) -> TenantRecord:
        """Apply ``changes`` (TenantConfig field -> value) to a tenant, validated as a whole."""
        unknown = set(changes) - set(TENANT_FIELDS)
        if unknown:
            raise InvalidArgument(sorted(unknown)[0], "not a tenant field that can be changed")
        with self._tx() as s:
            row = self._tenant_row(s, tenant_id)
            before = _record(row).config
            after = dataclasses.replace(before, **changes)
            check_tenant(after, self._lane_names(s))
            if after != before:
                for f in changes:
                    setattr(row, f, getattr(after, f))
                old, new = tenant_dict(before), tenant_dict(after)
                diff = [k for k in old if old[k] != new[k]]
                self.log_change(
                    s, actor, action, f"tenant:{tenant_id}",
                    {k: old[k] for k in diff}, {k: new[k] for k in diff},
                )  # fmt: skip
            s.flush()
            return _record(row)

    def delete_tenant(
        self, tenant_id: str, actor: Actor, guard: Callable[[TenantConfig], None]
    ) -> TenantRecord:
        """Delete a tenant; ``guard`` raises FailedPrecondition to refuse."""
        try:
            with self._tx() as s:
                row = self._tenant_row(s, tenant_id)
                record = _record(row)
                guard(record.config)
                s.delete(row)
                self.log_change(
                    s,
                    actor,
                    "tenant.delete",
                    f"tenant:{tenant_id}",
                    tenant_dict(record.config),
                    None,
                )
        except IntegrityError as exc:  # rows elsewhere still reference the tenant
            raise FailedPrecondition(
                f"tenant_id: tenant {tenant_id!r} is still referenced ({exc.orig})"
            ) from exc
        return record

    # -------------------------------------------------------------- lanes

    def lanes(self) -> list[LaneConfig]:
        with Session(self.engine) as s:
            return [lane_to_domain(r) for r in s.scalars(select(Lane).order_by(Lane.priority))]

    def update_lane(
        self, name: str, changes: Mapping[str, Any], actor: Actor, *, allow_missing: bool
    ) -> LaneConfig:
        unknown = set(changes) - set(LANE_FIELDS)
        if unknown:
            raise InvalidArgument(sorted(unknown)[0], "not a lane field that can be changed")
        with self._tx() as s:
            row = s.get(Lane, name)
            if row is None:
                if not allow_missing:
                    raise NotFound("name", f"unknown lane {name!r}")
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
                self.log_change(s, actor, action, f"lane:{name}", old, dataclasses.asdict(after))
            return after

    # ------------------------------------------------------------- policy

    def policy_overrides(self) -> dict[str, Any]:
        with Session(self.engine) as s:
            return {r.key: json.loads(r.value) for r in s.scalars(select(PolicyOverride))}

    def update_policy(
        self, base: Policy, set_: Mapping[str, Any], reset: list[str], actor: Actor
    ) -> tuple[Policy, dict[str, Any]]:
        """Set and/or reset policy keys, validated as a whole (e.g. the
        backpressure weights must still sum to 1). Returns the effective
        policy and the overrides now stored."""
        for key in [*set_, *reset]:
            if key not in POLICY_KEYS:
                raise InvalidArgument(key, "unknown policy key")
        both = set(set_) & set(reset)
        if both:
            raise InvalidArgument(sorted(both)[0], "both set and reset")
        with self._tx() as s:
            rows = {r.key: r for r in s.scalars(select(PolicyOverride))}
            current = {k: json.loads(r.value) for k, r in rows.items()}
            merged = {k: v for k, v in (current | dict(set_)).items() if k not in reset}
            old_policy = effective_policy(base, current)
            new_policy = effective_policy(base, merged)
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
            self.log_change(
                s, actor, "policy.update", "policy",
                {k: old_values[k] for k in changed}, {k: new_values[k] for k in changed},
            )  # fmt: skip
            stored_now = {k: new_values[k] for k in merged}
        return new_policy, stored_now

    # --------------------------------------------------------------- keys

    def create_key(self, name: str, role: Role, actor: Actor) -> tuple[str, KeyInfo]:
        with self._tx() as s:
            key, info = KeyStore.create(s, name, role, actor.name)
            self.log_change(s, actor, "key.create", f"key:{info.key_id}", None, key_dict(info))
        return key, info

    def revoke_key(self, key_id: str, actor: Actor) -> KeyInfo:
        with self._tx() as s:
            before, after = KeyStore.revoke(s, key_id)
            if before != after:
                self.log_change(
                    s, actor, "key.revoke", f"key:{key_id}", key_dict(before), key_dict(after)
                )
        return after

    # -------------------------------------------------------------- audit

    def audit(
        self,
        limit: int,
        before_id: int = 0,
        *,
        target: str = "",
        actor: str = "",
        action: str = "",
    ) -> tuple[list[AuditRecord], int]:
        """Newest first; the second value is the id to continue before (0 = done)."""
        with Session(self.engine) as s:
            q = select(AuditEvent).order_by(AuditEvent.id.desc()).limit(limit + 1)
            if before_id:
                q = q.where(AuditEvent.id < before_id)
            if target:
                q = q.where(AuditEvent.target == target)
            if actor:
                q = q.where(AuditEvent.actor.contains(actor, autoescape=True))
            if action:
                q = q.where(AuditEvent.action == action)
            rows = list(s.scalars(q))
        page = [_audit(r) for r in rows[:limit]]
        return page, (page[-1].id if len(rows) > limit and page else 0)

"""The audit log: ``log_change`` adds a record to the caller's transaction (so
a change and its record commit together, or neither), ``AuditLog`` reads it.
Every repository write calls ``log_change``; so it is also where a change is
announced to the running servers (``pg_notify`` on ``burstgate_config``, in
the same transaction: heard only if it commits; controlplane/store/notify.py)."""

from __future__ import annotations

import getpass
import json
from collections.abc import Mapping
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from controlplane.domain.audit import Actor, AuditRecord
from controlplane.store.models import AuditEvent
from controlplane.store.notify import CONFIG_CHANNEL, notify


def local_actor() -> Actor:
    """The actor of changes made in-process without an API key (the CLI's
    database-direct path, ``config apply``, the demo): ``local:<os user>``."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return Actor(f"local:{user}", "local")


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


def log_change(
    s: Session,
    actor: Actor,
    action: str,
    target: str,
    before: Mapping[str, Any] | None,
    after: Mapping[str, Any] | None,
) -> None:
    """Add an audit record to the session ``s`` (the caller's transaction,
    so the change and its record commit together). Operator RPCs pass
    ``controlplane.rpc.auth.current_actor()``; in-process callers
    ``local_actor()``. On PostgreSQL the change is announced on
    ``burstgate_config`` too: servers reload at once instead of at their
    next config poll."""
    notify(s, CONFIG_CHANNEL, f"{action} {target}")
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


def _audit(row: AuditEvent) -> AuditRecord:
    return AuditRecord(
        row.id, aware(row.at), row.actor, row.actor_role, row.action, row.target,
        row.before, row.after, row.request_id,
    )  # fmt: skip


class AuditLog:
    """Reads of the audit log (the writes are ``log_change``)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def list(
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

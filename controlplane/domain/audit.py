"""Who changed what: the actor of a change and an audit-log entry."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime


@dataclass(frozen=True, slots=True)
class Actor:
    """Who makes a change, as written to the audit log."""

    name: str  # "key:<key_id> (<key name>)" or "local:<os user>"
    role: str
    request_id: str = ""


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

"""SQLAlchemy 2 typed models. The schema itself is owned by Alembic
(``migrations/``); tests check that the two never drift."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Integer,
    MetaData,
    Numeric,
    String,
    Text,
    true,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# One naming convention so Alembic's generated constraint names are stable
# across PostgreSQL and SQLite.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# SQLite only auto-increments an INTEGER PRIMARY KEY; PostgreSQL gets BIGINT.
BigIntPK = BigInteger().with_variant(Integer(), "sqlite")


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Tenant(Base):
    """A tenant and its admission limits. NULL limits mean unlimited."""

    __tablename__ = "tenants"
    __table_args__ = (
        CheckConstraint("token_rate > 0", name="token_rate_positive"),
        CheckConstraint("burst_tokens >= 1", name="burst_positive"),
    )

    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(String(128), unique=True)
    display_name: Mapped[str] = mapped_column(String(256), default="")
    enabled: Mapped[bool] = mapped_column(Boolean, default=True)
    # Bucket refill in tokens per second (3 decimals = the fast path's milli-tokens).
    token_rate: Mapped[Decimal] = mapped_column(Numeric(16, 3))
    # Bucket capacity in tokens: the largest burst admitted at once.
    burst_tokens: Mapped[int] = mapped_column(BigInteger)
    hourly_quota: Mapped[int | None] = mapped_column(BigInteger, default=None)
    daily_quota: Mapped[int | None] = mapped_column(BigInteger, default=None)
    max_concurrency: Mapped[int | None] = mapped_column(Integer, default=None)
    max_queued: Mapped[int | None] = mapped_column(Integer, default=None)
    max_tokens_per_request: Mapped[int | None] = mapped_column(BigInteger, default=None)
    default_lane: Mapped[str] = mapped_column(String(32), default="standard")
    shadow_mode: Mapped[bool] = mapped_column(Boolean, default=False)
    # A dedicated quota is a hard cap: exhausted means refused, never queued.
    dedicated_quota: Mapped[int | None] = mapped_column(BigInteger, default=None)
    fallback_model: Mapped[str | None] = mapped_column(String(256), default=None)
    # Longest a request may wait in a queue (ms); NULL = the lane's wait target.
    max_wait_ms: Mapped[int | None] = mapped_column(Integer, default=None)
    # Length-aware placement: a request whose prompt + max_tokens exceeds this
    # goes to the lowest lane. NULL = the policy's long_request_tokens.
    long_request_tokens: Mapped[int | None] = mapped_column(BigInteger, default=None)
    # server_default: rows that existed before migration 0002 get True.
    demote_long_requests: Mapped[bool] = mapped_column(
        Boolean, default=True, server_default=true()
    )
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), default=utcnow, onupdate=utcnow
    )


class Lane(Base):
    """A priority lane (SPEC section 1). priority 0 is served first."""

    __tablename__ = "lanes"
    __table_args__ = (
        CheckConstraint("weight > 0 AND weight <= 1", name="weight_range"),
        CheckConstraint("wait_target_ms >= 0", name="wait_target_nonneg"),
    )

    name: Mapped[str] = mapped_column(String(32), primary_key=True)
    priority: Mapped[int] = mapped_column(Integer)
    weight: Mapped[Decimal] = mapped_column(Numeric(6, 4))
    # Queue-wait target (the lane's SLA), milliseconds.
    wait_target_ms: Mapped[int] = mapped_column(Integer)
    # Premium fails open: never refused by backpressure.
    fail_open: Mapped[bool] = mapped_column(Boolean, default=False)
    # Decisions in a degradable lane may carry degradation instructions.
    degradable: Mapped[bool] = mapped_column(Boolean, default=True)
    # Most requests waiting in this lane; NULL = the policy's lane_queue_limit.
    max_queued: Mapped[int | None] = mapped_column(Integer, default=None)
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), default=utcnow, onupdate=utcnow
    )


class PolicyOverride(Base):
    """Operator overrides of the burst-shaping policy (backpressure weights and
    thresholds, degradation triggers, queue bounds ...). One row per key; the
    value is JSON text. Keys and defaults live in controlplane.policy.Policy;
    a key without a row uses the default from settings."""

    __tablename__ = "policy_overrides"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(String(256))
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), default=utcnow, onupdate=utcnow
    )


# --- Admin API: API keys and the audit log (issue 5, controlplane/admin) ---


class ApiKey(Base):
    """An API key (operators: ``admin``/``viewer``) or per-sidecar token
    (``sidecar``). Only a salted hash of the secret is stored; the secret is
    shown once, when the key is created."""

    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    # Public part of the key (``bgk_<key_id>_<secret>``): finds the row, not secret.
    key_id: Mapped[str] = mapped_column(String(32), unique=True)
    name: Mapped[str] = mapped_column(String(128))
    role: Mapped[str] = mapped_column(String(16))
    # hex(HMAC-SHA256(salt, secret)); salt is 16 random bytes, hex.
    salt: Mapped[str] = mapped_column(String(64))
    secret_hash: Mapped[str] = mapped_column(String(128))
    created_by: Mapped[str] = mapped_column(String(256), default="")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), default=None)
    # Bumped on revoke: the server polls count + max(updated_at) to refresh its cache.
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), default=utcnow, onupdate=utcnow
    )


class AuditEvent(Base):
    """One change made through the admin API or the key CLI: who, when, what,
    and the object before and after (JSON; NULL for create/delete)."""

    __tablename__ = "audit_events"

    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, index=True)
    actor: Mapped[str] = mapped_column(String(256))
    actor_role: Mapped[str] = mapped_column(String(16))
    action: Mapped[str] = mapped_column(String(64))
    target: Mapped[str] = mapped_column(String(256), index=True)
    before: Mapped[str | None] = mapped_column(Text, default=None)
    after: Mapped[str | None] = mapped_column(Text, default=None)
    request_id: Mapped[str] = mapped_column(String(128), default="")

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
    Index,
    Integer,
    LargeBinary,
    MetaData,
    Numeric,
    String,
    Text,
    UniqueConstraint,
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
    demote_long_requests: Mapped[bool] = mapped_column(Boolean, default=True, server_default=true())
    # Engine pool of requests that name none (before the lane's); NULL = not configured.
    pool: Mapped[str | None] = mapped_column(String(128), default=None)
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
    # Engine pool of requests that name none and whose tenant has none; NULL = not configured.
    pool: Mapped[str | None] = mapped_column(String(128), default=None)
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), default=utcnow, onupdate=utcnow
    )


class PolicyOverride(Base):
    """Operator overrides of the burst-shaping policy (backpressure weights and
    thresholds, degradation triggers, queue bounds ...). One row per key; the
    value is JSON text. Keys and defaults live in controlplane.domain.policy.Policy;
    a key without a row uses the default from settings."""

    __tablename__ = "policy_overrides"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(String(256))
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), default=utcnow, onupdate=utcnow
    )


# --- Admin API: API keys and the audit log (rpc/admin.py, store/keys.py) ---


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
    # A sidecar key's scope: JSON lists of tenant ids or patterns, and of pools
    # ("*" = all); NULL for admin and viewer keys (a sidecar row with NULL may
    # act for nothing).
    tenants: Mapped[str | None] = mapped_column(Text, default=None)
    pools: Mapped[str | None] = mapped_column(Text, default=None)
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), default=None)
    # Written by the server at most once per config poll, leaving updated_at
    # alone (it would make every server reload its keys).
    last_used_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), default=None)
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


# --- Metering: dual ledger, price catalog, pricing windows, margin warnings ---
# (controlplane/ledger, controlplane/store/ledger.py; docs/ledger.md). Timestamps are integer
# nanoseconds since the Unix epoch (UTC) and amounts integer nano-units
# (1e-9) of the row's currency, so SUM() is exact on SQLite as on PostgreSQL.


class LedgerRecordRow(Base):
    """One settled request, both ledgers. The primary key is the idempotency
    key: a request id is recorded once per tenant, whatever the retries."""

    __tablename__ = "ledger_records"
    __table_args__ = (
        # The time axis of exports, margin windows and retention. BRIN on
        # PostgreSQL (rows arrive in settled_ns order, so block ranges are
        # tight and the index stays a few pages); a B-tree on SQLite.
        Index("ix_ledger_records_settled_ns", "settled_ns", postgresql_using="brin"),
    )

    tenant_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    request_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    reservation_id: Mapped[int] = mapped_column(BigInteger)
    lane: Mapped[str] = mapped_column(String(32))
    model: Mapped[str] = mapped_column(String(256))
    pool: Mapped[str] = mapped_column(String(128))
    arrival_ns: Mapped[int] = mapped_column(BigInteger)
    queue_start_ns: Mapped[int] = mapped_column(BigInteger)
    exec_start_ns: Mapped[int] = mapped_column(BigInteger)
    end_ns: Mapped[int] = mapped_column(BigInteger)
    settled_ns: Mapped[int] = mapped_column(BigInteger)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    cached_tokens: Mapped[int] = mapped_column(BigInteger)
    output_tokens: Mapped[int] = mapped_column(BigInteger)
    reserved_tokens: Mapped[int] = mapped_column(BigInteger)
    kv_cache_miss_rate: Mapped[Decimal] = mapped_column(Numeric(7, 6))
    miss_rate_source: Mapped[str] = mapped_column(String(8))  # request | window | none
    pricing_multiplier: Mapped[Decimal] = mapped_column(Numeric(12, 6))
    pricing_window: Mapped[int] = mapped_column(BigInteger)  # window start, Unix s; 0 = none
    lane_multiplier: Mapped[Decimal] = mapped_column(Numeric(12, 6))
    currency: Mapped[str] = mapped_column(String(3))
    user_charge_nanos: Mapped[int] = mapped_column(BigInteger)
    actual_cost_nanos: Mapped[int] = mapped_column(BigInteger)
    price_id: Mapped[int] = mapped_column(BigInteger)  # price_catalog.id; 0 = none
    # The caller's own id (CompleteRequest.correlation_id); NULL = none given.
    correlation_id: Mapped[str | None] = mapped_column(String(128), nullable=True)


class PriceCatalogEntry(Base):
    """User prices and GPU cost prices, per tenant and model ("*" = any).
    Token prices per million tokens; overhead per request."""

    __tablename__ = "price_catalog"
    __table_args__ = (UniqueConstraint("tenant_id", "model"),)

    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(String(128))
    model: Mapped[str] = mapped_column(String(256))
    currency: Mapped[str] = mapped_column(String(3))
    input_per_mtok: Mapped[Decimal] = mapped_column(Numeric(18, 9))
    cached_input_per_mtok: Mapped[Decimal] = mapped_column(Numeric(18, 9))
    output_per_mtok: Mapped[Decimal] = mapped_column(Numeric(18, 9))
    gpu_prefill_per_mtok: Mapped[Decimal] = mapped_column(Numeric(18, 9))
    gpu_decode_per_mtok: Mapped[Decimal] = mapped_column(Numeric(18, 9))
    gpu_overhead_per_request: Mapped[Decimal] = mapped_column(Numeric(18, 9))
    # JSON object lane -> multiplier (decimal text), e.g. {"premium": "1.5"}.
    lane_multipliers: Mapped[str] = mapped_column(Text, default="{}")
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), default=utcnow, onupdate=utcnow
    )


class PricingWindowRow(Base):
    """A pricing window of one pool and model: its cache-miss measurements,
    the multiplier in force during it and the one it sets for the next."""

    __tablename__ = "pricing_windows"

    pool: Mapped[str] = mapped_column(String(128), primary_key=True)
    model: Mapped[str] = mapped_column(String(256), primary_key=True)
    window_start: Mapped[int] = mapped_column(BigInteger, primary_key=True)  # Unix s
    window_s: Mapped[int] = mapped_column(Integer)
    completions: Mapped[int] = mapped_column(BigInteger)
    completion_weight: Mapped[int] = mapped_column(BigInteger)  # sum of prompt tokens
    completion_weighted_ppm: Mapped[int] = mapped_column(BigInteger)
    load_reports: Mapped[int] = mapped_column(BigInteger)
    load_ppm_sum: Mapped[int] = mapped_column(BigInteger)
    miss_rate_ppm: Mapped[int | None] = mapped_column(BigInteger, default=None)
    multiplier: Mapped[Decimal] = mapped_column(Numeric(12, 6))
    next_multiplier: Mapped[Decimal] = mapped_column(Numeric(12, 6))
    closed: Mapped[bool] = mapped_column(Boolean, default=False)


class MarginWarningRow(Base):
    """A tenant whose actual cost passed ratio x its user charge in a window."""

    __tablename__ = "margin_warnings"

    tenant_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    window_start: Mapped[int] = mapped_column(BigInteger, primary_key=True)  # Unix s
    currency: Mapped[str] = mapped_column(String(3), primary_key=True)
    window_s: Mapped[int] = mapped_column(Integer)
    requests: Mapped[int] = mapped_column(BigInteger)
    user_charge_nanos: Mapped[int] = mapped_column(BigInteger)
    actual_cost_nanos: Mapped[int] = mapped_column(BigInteger)
    ratio: Mapped[Decimal] = mapped_column(Numeric(12, 6))  # the threshold applied
    recorded_ns: Mapped[int] = mapped_column(BigInteger)


# --- Scale-out: members and cell leases (controlplane/ha, docs/ha.md) ---
# Used on PostgreSQL only (a shared database is what lets replicas meet); the
# tables exist on SQLite too so the schema stays one. Times are the
# database's clock (timestamptz): expiry is never judged by a replica's clock.


class HaMemberRow(Base):
    """A replica taking part in cell ownership, kept alive by heartbeats."""

    __tablename__ = "ha_members"

    member_id: Mapped[str] = mapped_column(Text, primary_key=True)
    address: Mapped[str] = mapped_column(Text)  # where sidecars reach it (host:port)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    heartbeat_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    draining: Mapped[bool] = mapped_column(Boolean, default=False)


class HaCellLeaseRow(Base):
    """A cell's lease: its owner until ``expires_at``, and the fencing epoch,
    raised by every acquisition and never lowered."""

    __tablename__ = "ha_cell_leases"

    cell_id: Mapped[str] = mapped_column(Text, primary_key=True)
    owner: Mapped[str | None] = mapped_column(Text, default=None)
    epoch: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), default=None)
    acquired_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), default=None)


class HaTenantAnchorRow(Base):
    """One row per tenant with shares: the row lock every writer of the
    tenant's shares takes first (controlplane/store/shares.py)."""

    __tablename__ = "ha_tenant_anchors"

    tenant_id: Mapped[str] = mapped_column(Text, primary_key=True)


class HaTenantRateRow(Base):
    """A replica's share of a tenant's rate and burst (controlplane/domain/shares.py):
    raised only into what the other replicas' live grants leave free."""

    __tablename__ = "ha_tenant_rates"

    tenant_id: Mapped[str] = mapped_column(Text, primary_key=True)
    member_id: Mapped[str] = mapped_column(Text, primary_key=True)
    demand: Mapped[int] = mapped_column(BigInteger)  # tokens/s asked of this member, smoothed
    rate_ppm: Mapped[int] = mapped_column(BigInteger)  # millionths of the tenant's rate
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), default=None)


class HaTenantQuotaRow(Base):
    """A replica's allowance in one of a tenant's quota windows: what it has
    used and what it may use; the allowances of one window sum to at most
    the quota."""

    __tablename__ = "ha_tenant_quotas"

    tenant_id: Mapped[str] = mapped_column(Text, primary_key=True)
    member_id: Mapped[str] = mapped_column(Text, primary_key=True)
    window_kind: Mapped[str] = mapped_column(Text, primary_key=True)  # "hour" | "day"
    window_start: Mapped[int] = mapped_column(BigInteger, primary_key=True)  # Unix s
    used: Mapped[int] = mapped_column(BigInteger)
    allowance: Mapped[int] = mapped_column(BigInteger)


class AdmissionKeyRow(Base):
    """The keys admissions are signed with (controlplane/service/signing.py,
    docs/ha.md "Signed admissions"): the highest generation is current, the
    one before it still verifies. In the database so that every replica of a
    deployment, and the plane after a restart, hold the same keys."""

    __tablename__ = "admission_keys"

    generation: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    secret: Mapped[bytes] = mapped_column(LargeBinary)  # 32 random bytes
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)

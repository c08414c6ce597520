"""tenants and lanes

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from decimal import Decimal

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "lanes",
        sa.Column("name", sa.String(length=32), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("weight", sa.Numeric(precision=6, scale=4), nullable=False),
        sa.Column("wait_target_ms", sa.Integer(), nullable=False),
        sa.Column("fail_open", sa.Boolean(), nullable=False),
        sa.Column("degradable", sa.Boolean(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("wait_target_ms >= 0", name=op.f("ck_lanes_wait_target_nonneg")),
        sa.CheckConstraint("weight > 0 AND weight <= 1", name=op.f("ck_lanes_weight_range")),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_lanes")),
    )
    op.create_table(
        "tenants",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("tenant_id", sa.String(length=128), nullable=False),
        sa.Column("display_name", sa.String(length=256), nullable=False),
        sa.Column("enabled", sa.Boolean(), nullable=False),
        sa.Column("token_rate", sa.Numeric(precision=16, scale=3), nullable=False),
        sa.Column("burst_tokens", sa.BigInteger(), nullable=False),
        sa.Column("hourly_quota", sa.BigInteger(), nullable=True),
        sa.Column("daily_quota", sa.BigInteger(), nullable=True),
        sa.Column("max_concurrency", sa.Integer(), nullable=True),
        sa.Column("max_queued", sa.Integer(), nullable=True),
        sa.Column("max_tokens_per_request", sa.BigInteger(), nullable=True),
        sa.Column("default_lane", sa.String(length=32), nullable=False),
        sa.Column("shadow_mode", sa.Boolean(), nullable=False),
        sa.Column("dedicated_quota", sa.BigInteger(), nullable=True),
        sa.Column("fallback_model", sa.String(length=256), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("burst_tokens >= 1", name=op.f("ck_tenants_burst_positive")),
        sa.CheckConstraint("token_rate > 0", name=op.f("ck_tenants_token_rate_positive")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tenants")),
        sa.UniqueConstraint("tenant_id", name=op.f("uq_tenants_tenant_id")),
    )
    # The spec's default lanes (SPEC section 1): weight and queue-wait target.
    # Operators change them later; these rows are reference data.
    lanes = sa.table(
        "lanes",
        sa.column("name", sa.String),
        sa.column("priority", sa.Integer),
        sa.column("weight", sa.Numeric),
        sa.column("wait_target_ms", sa.Integer),
        sa.column("fail_open", sa.Boolean),
        sa.column("degradable", sa.Boolean),
        sa.column("updated_at", sa.DateTime(timezone=True)),
    )
    now = datetime.now(UTC)
    op.bulk_insert(
        lanes,
        [
            {
                "name": "premium",
                "priority": 0,
                "weight": Decimal("0.40"),
                "wait_target_ms": 200,
                "fail_open": True,
                "degradable": False,
                "updated_at": now,
            },
            {
                "name": "standard",
                "priority": 1,
                "weight": Decimal("0.45"),
                "wait_target_ms": 800,
                "fail_open": False,
                "degradable": True,
                "updated_at": now,
            },
            {
                "name": "batch",
                "priority": 2,
                "weight": Decimal("0.15"),
                "wait_target_ms": 5000,
                "fail_open": False,
                "degradable": True,
                "updated_at": now,
            },
        ],
    )


def downgrade() -> None:
    op.drop_table("tenants")
    op.drop_table("lanes")

"""ha tenant grants: replicas' shares of a tenant's rate and quotas (issue 16)

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-04
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Created on SQLite too (one schema); only PostgreSQL uses them.
    op.create_table(  # one row per tenant: the lock every grant writer takes first
        "ha_tenant_anchors",
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("tenant_id", name=op.f("pk_ha_tenant_anchors")),
    )
    op.create_table(
        "ha_tenant_rates",
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("member_id", sa.Text(), nullable=False),
        sa.Column("demand", sa.BigInteger(), nullable=False),
        sa.Column("rate_ppm", sa.BigInteger(), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("tenant_id", "member_id", name=op.f("pk_ha_tenant_rates")),
    )
    op.create_table(
        "ha_tenant_quotas",
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("member_id", sa.Text(), nullable=False),
        sa.Column("window_kind", sa.Text(), nullable=False),
        sa.Column("window_start", sa.BigInteger(), nullable=False),
        sa.Column("used", sa.BigInteger(), nullable=False),
        sa.Column("allowance", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint(
            "tenant_id", "member_id", "window_kind", "window_start",
            name=op.f("pk_ha_tenant_quotas"),
        ),
    )


def downgrade() -> None:
    op.drop_table("ha_tenant_quotas")
    op.drop_table("ha_tenant_rates")
    op.drop_table("ha_tenant_anchors")

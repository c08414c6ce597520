"""ha members and cell leases (scale-out, issue 16)

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Created on SQLite too (one schema); only PostgreSQL uses them.
    op.create_table(
        "ha_members",
        sa.Column("member_id", sa.Text(), nullable=False),
        sa.Column("address", sa.Text(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("draining", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("member_id", name=op.f("pk_ha_members")),
    )
    op.create_table(
        "ha_cell_leases",
        sa.Column("cell_id", sa.Text(), nullable=False),
        sa.Column("owner", sa.Text(), nullable=True),
        sa.Column("epoch", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("acquired_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("cell_id", name=op.f("pk_ha_cell_leases")),
    )


def downgrade() -> None:
    op.drop_table("ha_cell_leases")
    op.drop_table("ha_members")

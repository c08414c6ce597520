"""burst shaping policy

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "policy_overrides",
        sa.Column("key", sa.String(length=64), nullable=False),
        sa.Column("value", sa.String(length=256), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("key", name=op.f("pk_policy_overrides")),
    )
    with op.batch_alter_table("lanes", schema=None) as batch_op:
        batch_op.add_column(sa.Column("max_queued", sa.Integer(), nullable=True))

    with op.batch_alter_table("tenants", schema=None) as batch_op:
        batch_op.add_column(sa.Column("max_wait_ms", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("long_request_tokens", sa.BigInteger(), nullable=True))
        batch_op.add_column(
            sa.Column(
                "demote_long_requests", sa.Boolean(), server_default=sa.true(), nullable=False
            )
        )


def downgrade() -> None:
    with op.batch_alter_table("tenants", schema=None) as batch_op:
        batch_op.drop_column("demote_long_requests")
        batch_op.drop_column("long_request_tokens")
        batch_op.drop_column("max_wait_ms")

    with op.batch_alter_table("lanes", schema=None) as batch_op:
        batch_op.drop_column("max_queued")

    op.drop_table("policy_overrides")

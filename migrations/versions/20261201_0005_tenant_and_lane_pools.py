"""tenant and lane engine pools

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Nullable: existing tenants and lanes keep no configured pool (their
    # requests go on to the lane's pool, then "default").
    with op.batch_alter_table("tenants", schema=None) as batch_op:
        batch_op.add_column(sa.Column("pool", sa.String(length=128), nullable=True))

    with op.batch_alter_table("lanes", schema=None) as batch_op:
        batch_op.add_column(sa.Column("pool", sa.String(length=128), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("lanes", schema=None) as batch_op:
        batch_op.drop_column("pool")

    with op.batch_alter_table("tenants", schema=None) as batch_op:
        batch_op.drop_column("pool")

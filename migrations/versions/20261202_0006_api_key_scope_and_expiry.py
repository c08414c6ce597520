"""api key scope, expiry and last use

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Sidecar keys made before scopes could act for every tenant and pool: they
# keep doing so, now said explicitly (and shown so by `keys list`).
EVERY = '["*"]'


def upgrade() -> None:
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.add_column(sa.Column("tenants", sa.Text(), nullable=True))
        batch_op.add_column(sa.Column("pools", sa.Text(), nullable=True))
        batch_op.add_column(sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True))
    keys = sa.table("api_keys", sa.column("role"), sa.column("tenants"), sa.column("pools"))
    op.execute(keys.update().where(keys.c.role == "sidecar").values(tenants=EVERY, pools=EVERY))


def downgrade() -> None:
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.drop_column("last_used_at")
        batch_op.drop_column("expires_at")
        batch_op.drop_column("pools")
        batch_op.drop_column("tenants")

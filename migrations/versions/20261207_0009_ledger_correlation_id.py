"""ledger correlation id: the caller's own id for a request (issue 30 item 3)

The HTTP sidecar keys a request's ledger row on an id it mints itself; the
client's x-request-id is kept beside it, for correlation only (not unique).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Nullable, no default: on PostgreSQL adding it rewrites nothing (a
    # catalog change), so a large ledger is migrated at once.
    with op.batch_alter_table("ledger_records") as batch:
        batch.add_column(sa.Column("correlation_id", sa.String(length=128), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("ledger_records") as batch:
        batch.drop_column("correlation_id")

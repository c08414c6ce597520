"""admission signing keys: Reannounce restores only signed admissions (issue 30)

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # The first key is created by the first server to start (store/signing.py),
    # not here: a migration's output (SQL scripts, logs) must hold no secret.
    op.create_table(
        "admission_keys",
        sa.Column("generation", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("secret", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("generation", name=op.f("pk_admission_keys")),
    )


def downgrade() -> None:
    op.drop_table("admission_keys")

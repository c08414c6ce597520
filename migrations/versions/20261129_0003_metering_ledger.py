"""Dual ledger, pricing windows and margin warnings.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# SQLite only auto-increments an INTEGER PRIMARY KEY; PostgreSQL gets BIGINT.
BigIntPK = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    # No surrogate id: the primary key (tenant_id, request_id) is the
    # exactly-once key, and one index less makes group commits cheaper.
    # Not partitioned: a unique key on a partitioned table must include the
    # partition column, which would let a request id be recorded twice
    # (docs/ledger.md, "Schema").
    op.create_table(
        "ledger_records",
        sa.Column("tenant_id", sa.String(length=128), nullable=False),
        sa.Column("request_id", sa.String(length=128), nullable=False),
        sa.Column("reservation_id", sa.BigInteger(), nullable=False),
        sa.Column("lane", sa.String(length=32), nullable=False),
        sa.Column("model", sa.String(length=256), nullable=False),
        sa.Column("pool", sa.String(length=128), nullable=False),
        sa.Column("arrival_ns", sa.BigInteger(), nullable=False),
        sa.Column("queue_start_ns", sa.BigInteger(), nullable=False),
        sa.Column("exec_start_ns", sa.BigInteger(), nullable=False),
        sa.Column("end_ns", sa.BigInteger(), nullable=False),
        sa.Column("settled_ns", sa.BigInteger(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cached_tokens", sa.BigInteger(), nullable=False),
        sa.Column("output_tokens", sa.BigInteger(), nullable=False),
        sa.Column("reserved_tokens", sa.BigInteger(), nullable=False),
        sa.Column("kv_cache_miss_rate", sa.Numeric(precision=7, scale=6), nullable=False),
        sa.Column("miss_rate_source", sa.String(length=8), nullable=False),
        sa.Column("pricing_multiplier", sa.Numeric(precision=12, scale=6), nullable=False),
        sa.Column("pricing_window", sa.BigInteger(), nullable=False),
        sa.Column("lane_multiplier", sa.Numeric(precision=12, scale=6), nullable=False),
        sa.Column("currency", sa.String(length=3), nullable=False),
        sa.Column("user_charge_nanos", sa.BigInteger(), nullable=False),
        sa.Column("actual_cost_nanos", sa.BigInteger(), nullable=False),
        sa.Column("price_id", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("tenant_id", "request_id", name=op.f("pk_ledger_records")),
    )
    # BRIN on PostgreSQL (append-mostly in settled_ns order), B-tree on SQLite.
    op.create_index(
        op.f("ix_ledger_records_settled_ns"),
        "ledger_records",
        ["settled_ns"],
        unique=False,
        postgresql_using="brin",
    )
    op.create_table(
        "price_catalog",
        sa.Column("id", BigIntPK, autoincrement=True, nullable=False),
        sa.Column("tenant_id", sa.String(length=128), nullable=False),
        sa.Column("model", sa.String(length=256), nullable=False),
        sa.Column("currency", sa.String(length=3), nullable=False),
        sa.Column("input_per_mtok", sa.Numeric(precision=18, scale=9), nullable=False),
        sa.Column("cached_input_per_mtok", sa.Numeric(precision=18, scale=9), nullable=False),
        sa.Column("output_per_mtok", sa.Numeric(precision=18, scale=9), nullable=False),
        sa.Column("gpu_prefill_per_mtok", sa.Numeric(precision=18, scale=9), nullable=False),
        sa.Column("gpu_decode_per_mtok", sa.Numeric(precision=18, scale=9), nullable=False),
        sa.Column("gpu_overhead_per_request", sa.Numeric(precision=18, scale=9), nullable=False),
        sa.Column("lane_multipliers", sa.Text(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_price_catalog")),
        sa.UniqueConstraint("tenant_id", "model", name=op.f("uq_price_catalog_tenant_id")),
    )
    op.create_table(
        "pricing_windows",
        sa.Column("pool", sa.String(length=128), nullable=False),
        sa.Column("model", sa.String(length=256), nullable=False),
        sa.Column("window_start", sa.BigInteger(), nullable=False),
        sa.Column("window_s", sa.Integer(), nullable=False),
        sa.Column("completions", sa.BigInteger(), nullable=False),
        sa.Column("completion_weight", sa.BigInteger(), nullable=False),
        sa.Column("completion_weighted_ppm", sa.BigInteger(), nullable=False),
        sa.Column("load_reports", sa.BigInteger(), nullable=False),
        sa.Column("load_ppm_sum", sa.BigInteger(), nullable=False),
        sa.Column("miss_rate_ppm", sa.BigInteger(), nullable=True),
        sa.Column("multiplier", sa.Numeric(precision=12, scale=6), nullable=False),
        sa.Column("next_multiplier", sa.Numeric(precision=12, scale=6), nullable=False),
        sa.Column("closed", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("pool", "model", "window_start", name=op.f("pk_pricing_windows")),
    )
    op.create_table(
        "margin_warnings",
        sa.Column("tenant_id", sa.String(length=128), nullable=False),
        sa.Column("window_start", sa.BigInteger(), nullable=False),
        sa.Column("currency", sa.String(length=3), nullable=False),
        sa.Column("window_s", sa.Integer(), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("user_charge_nanos", sa.BigInteger(), nullable=False),
        sa.Column("actual_cost_nanos", sa.BigInteger(), nullable=False),
        sa.Column("ratio", sa.Numeric(precision=12, scale=6), nullable=False),
        sa.Column("recorded_ns", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint(
            "tenant_id", "window_start", "currency", name=op.f("pk_margin_warnings")
        ),
    )


def downgrade() -> None:
    op.drop_table("margin_warnings")
    op.drop_table("pricing_windows")
    op.drop_table("price_catalog")
    op.drop_index(op.f("ix_ledger_records_settled_ns"), table_name="ledger_records")
    op.drop_table("ledger_records")

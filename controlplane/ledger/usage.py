"""Usage queries: both ledgers summed per tenant, UTC day, model, currency."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine  # a type: the SQL is in store/ledger_reads.py

from controlplane.domain.money import format_nanos
from controlplane.ledger.export import ExportSpec, Totals, daily_values, sql_totals
from controlplane.store.ledger_reads import daily_sums_query

# A usage answer is for people and dashboards; exports are for whole periods.
MAX_USAGE_ROWS = 10_000


def usage(
    engine: Engine, start_ns: int, end_ns: int, tenants: list[str]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    spec = ExportSpec(start_ns, end_ns, tuple(tenants), "csv", "daily").validate()
    keys = ("tenant_id", "day", "model", "currency", "requests", "prompt_tokens",
            "cached_tokens", "output_tokens", "user_charge", "actual_cost")  # fmt: skip
    with engine.connect() as conn:
        rows = [
            dict(zip(keys, daily_values(r), strict=True))
            for r in conn.execute(daily_sums_query(spec, limit=MAX_USAGE_ROWS))
        ]
        totals: dict[str, Totals] = sql_totals(conn, spec)
    return rows, [
        {
            "currency": c,
            "requests": t.requests,
            "prompt_tokens": t.prompt_tokens,
            "cached_tokens": t.cached_tokens,
            "output_tokens": t.output_tokens,
            "user_charge": format_nanos(t.user_charge_nanos),
            "actual_cost": format_nanos(t.actual_cost_nanos),
        }
        for c, t in sorted(totals.items())
    ]

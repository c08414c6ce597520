"""The margin report over any period: per tenant and currency, both ledgers,
the gross margin and the dynamic part of the user charge, and whether the
actual cost exceeds ``ratio`` x the user charge (``burstgate margin``).

Read like an export: in one snapshot (REPEATABLE READ on PostgreSQL, one
read transaction on SQLite), the records streamed in (tenant, currency)
order and summed here (the base charge is rounded per record:
``ledger/revenue.py``), and the sums checked against SQL ``SUM()`` per
tenant and currency taken in the same snapshot (``ExportMismatch``
otherwise), so the report reconciles with the ledger and with an export of
the same period.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from sqlalchemy import Engine  # a type: the SQL is in store/ledger_reads.py

from controlplane.domain.ledger_records import iso_ns
from controlplane.domain.money import format_fixed, format_nanos
from controlplane.ledger.export import FETCH_ROWS, ExportMismatch, ExportSpec
from controlplane.ledger.revenue import MicroCache, Sums, add_record
from controlplane.store.ledger import exceeds
from controlplane.store.ledger_reads import tenant_currency_records_query, tenant_currency_sums


@dataclass(frozen=True, slots=True)
class MarginRow:
    tenant_id: str
    currency: str
    sums: Sums
    warning: bool  # actual cost > ratio x user charge


@dataclass
class MarginReport:
    start_ns: int
    end_ns: int
    ratio: Decimal
    rows: list[MarginRow] = field(default_factory=list)
    totals: dict[str, Sums] = field(default_factory=dict)  # per currency

    @property
    def warned(self) -> bool:
        return any(r.warning for r in self.rows)

    def total_row(self, currency: str) -> MarginRow:
        t = self.totals[currency]
        return MarginRow("total", currency, t, exceeds(t.actual_cost_nanos, t.user_charge_nanos,
                                                       self.ratio))  # fmt: skip

    def as_json(self) -> dict[str, Any]:
        return {
            "period": {"start": iso_ns(self.start_ns), "end": iso_ns(self.end_ns)},
            "ratio": str(self.ratio),
            "tenants": [row_json(r) for r in self.rows],
            "totals": [row_json(self.total_row(c)) for c in sorted(self.totals)],
            "warned": self.warned,
        }


def row_json(r: MarginRow) -> dict[str, Any]:
    """A report row with exact figures: amounts as 9-decimal text, the
    margin in percent with 2 decimals (None when nothing was charged)."""
    s = r.sums
    pct = s.margin_percent()
    mean = s.mean_multiplier()
    return {
        "tenant_id": r.tenant_id,
        "currency": r.currency,
        "requests": s.requests,
        "prompt_tokens": s.prompt_tokens,
        "cached_tokens": s.cached_tokens,
        "output_tokens": s.output_tokens,
        "tokens": s.tokens,
        "user_charge": format_nanos(s.user_charge_nanos),
        "actual_cost": format_nanos(s.actual_cost_nanos),
        "gross_margin": format_nanos(s.gross_margin_nanos),
        "margin_percent": None if pct is None else str(pct),
        "base_charge": format_nanos(s.base_charge_nanos),
        "dynamic_revenue": format_nanos(s.dynamic_revenue_nanos),
        "pricing_multiplier": None if mean is None else format_fixed(mean, 6),
        "warning": r.warning,
    }


def margin_report(
    engine: Engine, start_ns: int, end_ns: int, tenants: Sequence[str], ratio: Decimal
) -> MarginReport:
    """Blocking; see the module docstring."""
    spec = ExportSpec(start_ns, end_ns, tuple(tenants)).validate()
    q = tenant_currency_records_query(spec)
    report = MarginReport(start_ns, end_ns, ratio)
    sums: dict[tuple[str, str], Sums] = {}
    micro = MicroCache()
    options: dict[str, Any] = {}
    if engine.dialect.name == "postgresql":
        options["isolation_level"] = "REPEATABLE READ"  # one snapshot for rows and sums
    with engine.connect().execution_options(**options) as conn, conn.begin():
        expected = tenant_currency_sums(conn, spec)
        cursor = conn.execution_options(stream_results=True, yield_per=FETCH_ROWS).execute(q)
        for part in cursor.partitions():
            for r in part:
                key = (r[0], r[1])
                s = sums.get(key)
                if s is None:  # (tenant, currency) order: a new group
                    s = sums[key] = Sums()
                add_record(s, r, 2, micro)
    got = {k: s.key() for k, s in sums.items()}
    if got != expected:
        raise ExportMismatch(f"margin rows add up to {got}, the database's SUM() to {expected}")
    for (tenant_id, currency), s in sums.items():
        warn = exceeds(s.actual_cost_nanos, s.user_charge_nanos, ratio)
        report.rows.append(MarginRow(tenant_id, currency, s, warn))
        report.totals.setdefault(currency, Sums()).merge(s)
    return report

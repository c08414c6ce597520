"""The ledger's read queries over a period: for the export, the usage answer
(``GetUsage``) and the margin report (``controlplane/ledger/``).

Built here and run by those use cases on their own connection, because they
read rows and SQL ``SUM()``s in one snapshot and stream the rows; what they
do with the rows (formatting, summing the base charge per record,
reconciling) is theirs. A period is half-open on ``settled_ns`` and limited
to its tenants when it names any.
"""

from __future__ import annotations

from typing import Any, Protocol

from sqlalchemy import Connection, Select, String, cast, func, literal_column, select

from controlplane.domain.ledger_records import COLUMNS
from controlplane.domain.units import NS_PER_DAY
from controlplane.store.ledger import LEDGER


class Period(Protocol):
    """What a query reads of the caller's spec (``ExportSpec`` is one)."""

    @property
    def start_ns(self) -> int: ...
    @property
    def end_ns(self) -> int: ...
    @property
    def tenants(self) -> tuple[str, ...]: ...


# What the daily export and the margin report read of each record.
SUM_COLUMNS = ("prompt_tokens", "cached_tokens", "output_tokens", "user_charge_nanos",
               "actual_cost_nanos", "pricing_multiplier")  # fmt: skip


def period_filter(q: Select[Any], period: Period) -> Select[Any]:
    """Rows settled in the half-open period (and of its tenants)."""
    q = q.where(LEDGER.c.settled_ns >= period.start_ns, LEDGER.c.settled_ns < period.end_ns)
    if period.tenants:
        q = q.where(LEDGER.c.tenant_id.in_(sorted(set(period.tenants))))
    return q


def _sums() -> list[Any]:
    """The SQL-summable figures: count, tokens, both ledgers' amounts."""
    c = LEDGER.c
    return [
        func.count(),
        func.sum(c.prompt_tokens),
        func.sum(c.cached_tokens),
        func.sum(c.output_tokens),
        func.sum(c.user_charge_nanos),
        func.sum(c.actual_cost_nanos),
    ]


def currency_sums(conn: Connection, period: Period) -> dict[str, tuple[int, ...]]:
    """Per currency, the ``_sums()`` figures straight from SQL (None as 0)."""
    q = period_filter(select(LEDGER.c.currency, *_sums()), period).group_by(LEDGER.c.currency)
    return {row[0]: tuple(int(v or 0) for v in row[1:]) for row in conn.execute(q)}


def tenant_currency_sums(
    conn: Connection, period: Period
) -> dict[tuple[str, str], tuple[int, ...]]:
    """Per (tenant, currency), the ``_sums()`` figures straight from SQL."""
    c = LEDGER.c
    q = period_filter(select(c.tenant_id, c.currency, *_sums()), period)
    q = q.group_by(c.tenant_id, c.currency)
    return {(r[0], r[1]): tuple(int(v or 0) for v in r[2:]) for r in conn.execute(q)}


def _day_expr() -> Any:
    # Integer division on both databases (bigint / bigint; integer / integer).
    return LEDGER.c.settled_ns.op("/")(literal_column(str(NS_PER_DAY)))


def sum_columns() -> list[Any]:
    """``SUM_COLUMNS`` as selected. The multiplier comes as text: a cheap
    key for the caller's per-multiplier cache (a Decimal built and hashed
    per row cost more than the rest of the row's work)."""
    c = LEDGER.c
    text_multiplier = cast(c.pricing_multiplier, String).label("pricing_multiplier")
    return [*(c[name] for name in SUM_COLUMNS[:-1]), text_multiplier]


def request_rows_query(period: Period) -> Select[Any]:
    """Every record of the period, all ``COLUMNS``, in export order
    (tenant, settled time, request id)."""
    c = LEDGER.c
    q = select(*(c[name] for name in COLUMNS))
    return period_filter(q, period).order_by(c.tenant_id, c.settled_ns, c.request_id)


def daily_records_query(period: Period) -> Select[Any]:
    """Each record of the period in daily-row order, with its group key
    (tenant, day, model, currency) first: consecutive rows of one group."""
    c = LEDGER.c
    day = _day_expr().label("day")
    q = select(c.tenant_id, day, c.model, c.currency, *sum_columns())
    return period_filter(q, period).order_by(c.tenant_id, day, c.model, c.currency)


def daily_sums_query(period: Period, limit: int | None = None) -> Select[Any]:
    """SQL-summed (tenant, day, model, currency) groups, in that order, the
    first ``limit`` of them (``GetUsage``: no base charge, which is summed
    per record)."""
    c = LEDGER.c
    day = _day_expr().label("day")
    q = select(c.tenant_id, day, c.model, c.currency, *_sums())
    q = (
        period_filter(q, period)
        .group_by(c.tenant_id, day, c.model, c.currency)
        .order_by(c.tenant_id, day, c.model, c.currency)
    )
    return q if limit is None else q.limit(limit)


def tenant_currency_records_query(period: Period) -> Select[Any]:
    """Each record of the period as (tenant, currency, ``SUM_COLUMNS``), in
    (tenant, currency) order: consecutive rows of one group."""
    c = LEDGER.c
    q = period_filter(select(c.tenant_id, c.currency, *sum_columns()), period)
    return q.order_by(c.tenant_id, c.currency)

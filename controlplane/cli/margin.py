"""``burstgate margin``: the margin report over any period, on the database.

It runs on the database directly, as ``export`` does, not through the
server: the API's ``GetMarginReport`` carries neither tokens nor the base
charge, and a finance report should not need a running server (nor an API
key) to be produced for a closed month. See ``ledger/margin.py``.
"""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from typing import TYPE_CHECKING, Annotated

import typer

from controlplane.cli.common import DbOpt, echo_json, settings
from controlplane.cli.ledger import TenantOpt, _engine, _period
from controlplane.cli.render import cell, table
from controlplane.domain.errors import InvalidArgument
from controlplane.domain.units import NS_PER_S

if TYPE_CHECKING:  # the report module imports SQLAlchemy: only when the command runs
    from controlplane.ledger.margin import MarginReport, MarginRow

COLUMNS = ("tenant_id", "currency", "requests", "tokens", "user_charge", "actual_cost",
           "gross_margin", "margin_%", "dynamic_revenue", "warning")  # fmt: skip


def _ratio(value: str | None) -> Decimal:
    if value is None:
        ratio: Decimal = settings().margin_warning_ratio
        return ratio
    from controlplane.domain.money import parse_decimal

    try:
        return parse_decimal(
            "--ratio", value, decimals=6, maximum=Decimal(1_000_000), allow_equal_min=False
        )
    except InvalidArgument as exc:
        raise typer.BadParameter(exc.description, param_hint="'--ratio'") from None


def _view(r: MarginRow) -> dict[str, object]:
    from controlplane.ledger.margin import row_json

    j = row_json(r)
    pct = j["margin_percent"]
    return j | {"margin_%": None if pct is None else f"{pct}%"}


def _print(report: MarginReport) -> None:
    from controlplane.ledger.margin import row_json

    start, end = (cell(datetime.fromtimestamp(ns // NS_PER_S, UTC))
                  for ns in (report.start_ns, report.end_ns))  # fmt: skip
    typer.echo(
        f"margin of requests settled from {start} to {end} UTC (end excluded); "
        f"warning when actual_cost > {report.ratio} x user_charge"
    )
    if not report.rows:
        typer.echo("no settled requests in the period")
        return
    # One table per currency: amounts in different currencies do not add up.
    for currency in sorted(report.totals):
        typer.echo("")
        rows = [_view(r) for r in report.rows if r.currency == currency]
        table(rows, COLUMNS, footer=_view(report.total_row(currency)))
    for r in report.rows:
        if r.warning:
            s = r.sums
            typer.echo(
                f"margin warning: {r.tenant_id}: actual cost {row_json(r)['actual_cost']} "
                f"{r.currency} > {report.ratio} x user charge {row_json(r)['user_charge']} "
                f"(requests {s.requests})",
                err=True,
            )


def margin_command(
    start: Annotated[str, typer.Option("--from", help="Period start (ISO 8601 or Unix s).")],
    end: Annotated[str | None, typer.Option("--to", help="Period end; default: now.")] = None,
    tenant: TenantOpt = None,
    ratio: Annotated[
        str | None,
        typer.Option(help="Warning threshold (> 0); default BURSTGATE_MARGIN_WARNING_RATIO."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
    database_url: DbOpt = None,
) -> None:
    """Margin report over any period: per tenant, and a total per currency.

    Requests, tokens, user charge, actual cost, gross margin and margin %,
    and the revenue from the dynamic multiplier (the user charge minus the
    charge at multiplier 1). Runs on the database (no server needed).
    Exit code 1 if any tenant's actual cost exceeds ratio x its user
    charge."""
    from controlplane.ledger.margin import margin_report

    threshold = _ratio(ratio)
    s, e = _period(start, end)
    engine = _engine(database_url)
    try:
        report = margin_report(engine, s, e, tenant or (), threshold)
    finally:
        engine.dispose()
    if as_json:
        echo_json(report.as_json())
    else:
        _print(report)
    if report.warned:
        raise typer.Exit(1)

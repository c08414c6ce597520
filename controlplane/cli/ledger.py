"""``burstgate export``, ``burstgate price ...`` and ``burstgate margin``
(``cli/margin.py``): run against the database directly (no server needed)."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Annotated, Any

import typer

from controlplane.cli.common import settings
from controlplane.cli.render import table
from controlplane.domain.errors import InvalidArgument, excerpt
from controlplane.domain.exportspec import ExportFormat, Granularity

DbOpt = Annotated[
    str | None,
    typer.Option("--database-url", help="Overrides BURSTGATE_DATABASE_URL.", show_default=False),
]
TenantOpt = Annotated[
    list[str] | None,
    typer.Option("--tenant", "-t", help="Tenant id (repeatable); default: all tenants."),
]

PRICE_COLUMNS = ("tenant_id", "model", "currency", "input", "cached_input", "output",
                 "gpu_prefill", "gpu_decode", "gpu_overhead", "lane_multipliers")  # fmt: skip
price_app = typer.Typer(
    help="The price catalog: user prices and GPU cost prices per tenant and model "
    "('*' = default). Token prices are per million tokens.",
    no_args_is_help=True,
)


def _engine(database_url: str | None) -> Any:
    from controlplane.store.ledger_write import ledger_engine

    return ledger_engine(settings(database_url=database_url).database_url)


def _period(start: str, end: str | None) -> tuple[int, int]:
    """The period of ``--from`` / ``--to``: each a time the ledger can hold
    (1970 to 2262), the end after the start; else a usage error naming the
    option (exit code 2), never a database error."""
    import time

    from controlplane.domain.exportspec import parse_when

    try:
        s = parse_when("--from", start)
        e = parse_when("--to", end) if end else time.time_ns()
    except InvalidArgument as exc:
        raise typer.BadParameter(exc.description, param_hint=f"'{exc.field}'") from None
    if e <= s:
        raise typer.BadParameter("must be after --from", param_hint="'--to'")
    return s, e


def export_command(
    start: Annotated[
        str, typer.Option("--from", help="Period start: ISO 8601 (naive = UTC) or Unix seconds.")
    ],
    end: Annotated[
        str | None, typer.Option("--to", help="Period end (exclusive); default: now.")
    ] = None,
    tenant: TenantOpt = None,
    fmt: Annotated[
        ExportFormat, typer.Option("--format", "-f", help="File format.")
    ] = ExportFormat.CSV,
    granularity: Annotated[
        Granularity,
        typer.Option(
            "--granularity",
            "-g",
            help="request: one row each; daily: per tenant, model and UTC day.",
        ),
    ] = Granularity.REQUEST,
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="Output file; default: standard output.")
    ] = None,
    manifest: Annotated[
        Path | None,
        typer.Option(help="Manifest (totals) file; default: OUT.manifest.json, or stderr."),
    ] = None,
    database_url: DbOpt = None,
) -> None:
    """Export the ledger (both sides) for billing, with a manifest whose totals
    reconcile with SUM() in the database. Deterministic: same records, same bytes."""
    from controlplane.ledger.export import ExportResult, ExportSpec, export, manifest_json

    s, e = _period(start, end)
    spec = ExportSpec(s, e, tuple(tenant or ()), str(fmt), str(granularity)).validate()
    if fmt == "parquet" and out is None:
        raise InvalidArgument("--out", "parquet needs an output file")
    engine = _engine(database_url)
    result = ExportResult()
    try:
        if out is None:
            for chunk in export(engine, spec, result):
                sys.stdout.buffer.write(chunk)
            sys.stdout.buffer.flush()
        else:
            tmp = out.with_name(out.name + ".partial")
            with tmp.open("wb") as fh:
                for chunk in export(engine, spec, result):
                    fh.write(chunk)
            tmp.replace(out)  # never a half-written export under the real name
    finally:
        engine.dispose()
    text = manifest_json(result)
    if result.set_aside:
        typer.echo(f"warning: {result.set_aside} ledger records could not be written and were "
                   "set aside; the manifest's set_aside names them", err=True)  # fmt: skip
    target = manifest or (out.with_name(out.name + ".manifest.json") if out else None)
    if target is None:
        sys.stderr.write(text)
    else:
        target.write_text(text)
        typer.echo(f"{result.rows} rows -> {out}; manifest {target}", err=True)


@contextlib.contextmanager
def _store(database_url: str | None) -> Iterator[Any]:
    from controlplane.store.ledger import LedgerStore

    engine = _engine(database_url)
    try:
        yield LedgerStore(engine)
    finally:
        engine.dispose()


@price_app.command("set")
def price_set(
    tenant_id: Annotated[str, typer.Argument(help="Tenant id, or '*' for the default.")],
    model: Annotated[str, typer.Option(help="Model, or '*' for any.")] = "*",
    currency: Annotated[str, typer.Option(help="ISO 4217 code.")] = "USD",
    input_price: Annotated[
        str, typer.Option("--input", help="User price per 1M uncached input tokens.")
    ] = "0",
    cached_input: Annotated[str, typer.Option(help="User price per 1M cached input tokens.")] = "0",
    output: Annotated[str, typer.Option(help="User price per 1M output tokens.")] = "0",
    gpu_prefill: Annotated[str, typer.Option(help="GPU cost per 1M prefill tokens.")] = "0",
    gpu_decode: Annotated[str, typer.Option(help="GPU cost per 1M decode tokens.")] = "0",
    gpu_overhead: Annotated[str, typer.Option(help="GPU cost per request.")] = "0",
    lane_multiplier: Annotated[
        list[str] | None,
        typer.Option(help="LANE=MULTIPLIER of the user charge, e.g. premium=1.5 (repeatable)."),
    ] = None,
    database_url: DbOpt = None,
) -> None:
    """Create or replace a price entry (a running server picks it up within
    BURSTGATE_CONFIG_POLL_S)."""
    from controlplane.domain.catalog import PriceEntry, parse_lane_multipliers
    from controlplane.domain.money import MAX_PRICE, PRICE_DECIMALS, parse_decimal

    def price(name: str, value: str) -> Decimal:
        return parse_decimal(name, value, decimals=PRICE_DECIMALS, maximum=MAX_PRICE)

    entry = PriceEntry(
        tenant_id=tenant_id,
        model=model,
        currency=currency,
        input_per_mtok=price("input", input_price),
        cached_input_per_mtok=price("cached_input", cached_input),
        output_per_mtok=price("output", output),
        gpu_prefill_per_mtok=price("gpu_prefill", gpu_prefill),
        gpu_decode_per_mtok=price("gpu_decode", gpu_decode),
        gpu_overhead_per_request=price("gpu_overhead", gpu_overhead),
        lane_multipliers=parse_lane_multipliers(lane_multiplier or ()),
    )
    with _store(database_url) as store:
        saved = store.upsert_price(entry)
        typer.echo(f"price {saved.tenant_id}/{saved.model} saved (id {saved.id})")


def _price_json(e: Any) -> dict[str, Any]:
    from controlplane.domain.catalog import PRICE_FIELDS

    return {
        "id": e.id,
        "tenant_id": e.tenant_id,
        "model": e.model,
        "currency": e.currency,
        **{name: str(getattr(e, name)) for name in PRICE_FIELDS},
        "lane_multipliers": {k: str(v) for k, v in sorted(e.lane_multipliers.items())},
    }


@price_app.command("list")
def price_list(
    as_json: Annotated[bool, typer.Option("--json", help="JSON output.")] = False,
    database_url: DbOpt = None,
) -> None:
    """List the price catalog (token prices per million tokens)."""
    with _store(database_url) as store:
        entries = [_price_json(e) for e in store.load_catalog()]
    if as_json:
        typer.echo(json.dumps(entries, indent=2))
        return
    # Columns named as the options of `price set`.
    rows = [
        {"tenant_id": e["tenant_id"], "model": e["model"], "currency": e["currency"],
         "input": e["input_per_mtok"], "cached_input": e["cached_input_per_mtok"],
         "output": e["output_per_mtok"], "gpu_prefill": e["gpu_prefill_per_mtok"],
         "gpu_decode": e["gpu_decode_per_mtok"], "gpu_overhead": e["gpu_overhead_per_request"],
         "lane_multipliers": ",".join(f"{k}={v}" for k, v in e["lane_multipliers"].items())}
        for e in entries
    ]  # fmt: skip
    table(rows, PRICE_COLUMNS)


@price_app.command("delete")
def price_delete(
    tenant_id: str,
    model: Annotated[str, typer.Option(help="Model, or '*'.")] = "*",
    database_url: DbOpt = None,
) -> None:
    """Delete a price entry."""
    from controlplane.domain.errors import NotFound

    with _store(database_url) as store:
        if not store.delete_price(tenant_id, model):
            raise NotFound("tenant_id", f"no price for {excerpt(tenant_id)} / {excerpt(model)}")
        typer.echo(f"price {tenant_id}/{model} deleted")


def register(app: typer.Typer) -> None:
    """Add ``export`` and ``price`` to the ``burstgate`` app (``margin``:
    ``cli/margin.py``)."""
    app.command("export")(export_command)
    app.add_typer(price_app, name="price")

"""``burstgate tenant ...``: add, list and change tenants in the database."""

from __future__ import annotations

import json
from decimal import Decimal, InvalidOperation
from typing import Annotated, Any

import typer

from controlplane.cli.common import DbOpt, fail
from controlplane.cli.config import _repo

tenant_app = typer.Typer(
    help="Add, list and change tenants (writes the database; a running "
    "server picks changes up within BURSTGATE_CONFIG_POLL_S).",
    no_args_is_help=True,
)


def _decimal(value: str, name: str) -> Decimal:
    try:
        return Decimal(value)
    except InvalidOperation:
        fail(f"{name}: not a number: {value!r}")


@tenant_app.command("add")
def tenant_add(
    tenant_id: Annotated[str, typer.Argument(help="Tenant id as sidecars send it.")],
    rate: Annotated[str, typer.Option("--rate", help="Token refill, tokens/s (3 decimals).")],
    burst: Annotated[int, typer.Option("--burst", help="Bucket capacity, tokens.")],
    hourly_quota: Annotated[int | None, typer.Option(help="Tokens per UTC hour.")] = None,
    daily_quota: Annotated[int | None, typer.Option(help="Tokens per UTC day.")] = None,
    max_concurrency: Annotated[int | None, typer.Option(help="Requests in flight.")] = None,
    max_tokens_per_request: Annotated[int | None, typer.Option(help="Cap on max_tokens.")] = None,
    default_lane: Annotated[str, typer.Option(help="Lane when a request names none.")] = "standard",
    display_name: Annotated[str, typer.Option(help="Human-readable name.")] = "",
    database_url: DbOpt = None,
) -> None:
    """Add a tenant."""
    from controlplane.domain import TenantConfig

    cfg = TenantConfig(
        tenant_id=tenant_id,
        token_rate=_decimal(rate, "--rate"),
        burst_tokens=burst,
        hourly_quota=hourly_quota,
        daily_quota=daily_quota,
        max_concurrency=max_concurrency,
        max_tokens_per_request=max_tokens_per_request,
        default_lane=default_lane,
        display_name=display_name,
    )
    with _repo(database_url) as repo:
        repo.add_tenant(cfg)
    typer.echo(f"tenant {tenant_id} added")


def _tenant_dict(t: Any) -> dict[str, Any]:
    from dataclasses import asdict

    d = asdict(t)
    d["token_rate"] = str(d["token_rate"])
    return d


@tenant_app.command("list")
def tenant_list(
    as_json: Annotated[bool, typer.Option("--json")] = False, database_url: DbOpt = None
) -> None:
    """List tenants."""
    with _repo(database_url) as repo:
        tenants = repo.tenants()
    if as_json:
        typer.echo(json.dumps([_tenant_dict(t) for t in tenants], indent=2))
        return
    cols = (
        "tenant_id",
        "enabled",
        "token_rate",
        "burst_tokens",
        "hourly_quota",
        "daily_quota",
        "max_concurrency",
        "default_lane",
    )
    rows = [
        [str(getattr(t, c) if getattr(t, c) is not None else "-") for c in cols] for t in tenants
    ]
    widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(cols)]
    typer.echo("  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)))
    for r in rows:
        typer.echo("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)))


@tenant_app.command("show")
def tenant_show(tenant_id: str, database_url: DbOpt = None) -> None:
    """Show one tenant as JSON."""
    with _repo(database_url) as repo:
        typer.echo(json.dumps(_tenant_dict(repo.get_tenant(tenant_id).config), indent=2))


@tenant_app.command("disable")
def tenant_disable(tenant_id: str, database_url: DbOpt = None) -> None:
    """Refuse the tenant's requests with TENANT_DISABLED."""
    with _repo(database_url) as repo:
        repo.set_enabled(tenant_id, False)
    typer.echo(f"tenant {tenant_id} disabled")


@tenant_app.command("enable")
def tenant_enable(tenant_id: str, database_url: DbOpt = None) -> None:
    """Admit the tenant's requests again."""
    with _repo(database_url) as repo:
        repo.set_enabled(tenant_id, True)
    typer.echo(f"tenant {tenant_id} enabled")

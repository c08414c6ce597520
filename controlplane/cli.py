"""The ``burstgate`` command."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from pydantic import ValidationError

from controlplane.errors import DomainError

app = typer.Typer(
    help="burstgate: burst-aware admission control for multi-tenant LLM serving.",
    no_args_is_help=True,
    add_completion=False,
)
tenant_app = typer.Typer(
    help="Add, list and change tenants (writes the database; a running "
    "server picks changes up within BURSTGATE_CONFIG_POLL_S).",
    no_args_is_help=True,
)
config_app = typer.Typer(help="Declarative YAML config (lanes and tenants).", no_args_is_help=True)
app.add_typer(tenant_app, name="tenant")
app.add_typer(config_app, name="config")

DbOpt = Annotated[
    str | None,
    typer.Option("--database-url", help="Overrides BURSTGATE_DATABASE_URL.", show_default=False),
]


def _fail(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def _settings(**overrides: Any) -> Any:
    from controlplane.settings import Settings

    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        first = exc.errors()[0]
        name = "BURSTGATE_" + str(first["loc"][0]).upper() if first["loc"] else "settings"
        _fail(f"{name}: {first['msg']}")


@contextlib.contextmanager
def _repo(database_url: str | None) -> Iterator[Any]:
    from controlplane.store.db import make_engine
    from controlplane.store.repo import ConfigRepository

    engine = make_engine(_settings(database_url=database_url).database_url)
    try:
        yield ConfigRepository(engine)
    finally:
        engine.dispose()


@app.command()
def migrate(database_url: DbOpt = None) -> None:
    """Create or upgrade the database schema (alembic upgrade head)."""
    from controlplane.store.db import upgrade

    url = _settings(database_url=database_url).database_url
    upgrade(url)
    typer.echo("database at head")


def _serve(settings: Any) -> None:
    from controlplane import logs, server

    logs.configure(settings.log_format, settings.log_level)

    def ready(plane: server.ControlPlane) -> None:
        # A plain line on stdout that scripts and tests can wait for.
        metrics = (
            f"http://{settings.host}:{plane.metrics_port}/metrics" if plane.metrics_port else "off"
        )
        print(
            f"burstgate listening on {settings.host}:{plane.port} "
            f"(fastpath={plane.service.implementation}, metrics={metrics})",
            flush=True,
        )

    server.run(settings, on_ready=ready)


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="Overrides BURSTGATE_HOST.")] = None,
    port: Annotated[
        int | None, typer.Option(help="Overrides BURSTGATE_PORT (0 = free port).")
    ] = None,
    metrics_port: Annotated[int | None, typer.Option(help="-1 disables /metrics.")] = None,
    database_url: DbOpt = None,
    migrate_first: Annotated[
        bool, typer.Option("--migrate/--no-migrate", help="Run migrations before serving.")
    ] = False,
) -> None:
    """Run the gRPC control plane until SIGTERM/SIGINT."""
    settings = _settings(host=host, port=port, metrics_port=metrics_port, database_url=database_url)
    if migrate_first:
        from controlplane.store.db import upgrade

        upgrade(settings.database_url)
    _serve(settings)


@app.command()
def demo(
    port: Annotated[int | None, typer.Option(help="Overrides BURSTGATE_PORT.")] = None,
    database_url: DbOpt = None,
    admission_auth: Annotated[
        bool,
        typer.Option(
            "--admission-auth/--no-admission-auth",
            help="Require sidecar tokens on the admission API (off in the demo; "
            "`serve` requires them unless BURSTGATE_ADMISSION_AUTH=false).",
        ),
    ] = False,
) -> None:
    """Migrate the database, load the demo tenants and lanes, and serve."""
    from controlplane import configfile
    from controlplane.store.db import make_engine, upgrade
    from controlplane.store.repo import ConfigRepository

    settings = _settings(port=port, database_url=database_url, admission_auth=admission_auth)
    upgrade(settings.database_url)
    engine = make_engine(settings.database_url)
    try:
        created, updated = configfile.apply(
            ConfigRepository(engine), configfile.load(configfile.DEMO_CONFIG)
        )
        _demo_prices(engine)
    finally:
        engine.dispose()
    typer.echo(
        f"demo config: {created} tenants created, {updated} updated "
        f"({configfile.DEMO_CONFIG.name}); database {settings.database_url}"
    )
    _serve(settings)


def _demo_prices(engine: Any) -> None:
    """A default price-catalog entry, so the demo's ledger shows money (only
    when the catalog is empty: operators' prices are never overwritten)."""
    from decimal import Decimal as D

    from controlplane.ledger.catalog import ANY, PriceEntry
    from controlplane.ledger.store import LedgerStore

    store = LedgerStore(engine)
    if store.load_catalog():
        return
    # USD per million tokens (and per request for the overhead): a small
    # open-model price list; the GPU side is what the tokens cost to serve.
    store.upsert_price(
        PriceEntry(
            ANY, ANY, "USD",
            input_per_mtok=D("0.50"), cached_input_per_mtok=D("0.10"), output_per_mtok=D("1.50"),
            gpu_prefill_per_mtok=D("0.20"), gpu_decode_per_mtok=D("0.80"),
            gpu_overhead_per_request=D("0.00002"), lane_multipliers={"premium": D("1.5")},
        )
    )  # fmt: skip


@config_app.command("apply")
def config_apply(
    path: Annotated[Path, typer.Argument(help="YAML file with lanes/tenants.")],
    database_url: DbOpt = None,
) -> None:
    """Create or update the lanes and tenants in a YAML file."""
    from controlplane import configfile

    with _repo(database_url) as repo:
        created, updated = configfile.apply(repo, configfile.load(path))
    typer.echo(f"{created} tenants created, {updated} updated")


def _decimal(value: str, name: str) -> Decimal:
    try:
        return Decimal(value)
    except InvalidOperation:
        _fail(f"{name}: not a number: {value!r}")


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
        typer.echo(json.dumps(_tenant_dict(repo.get_tenant(tenant_id)), indent=2))


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


def _register_plugins() -> None:
    # `burstgate admin ...` (admin API over gRPC) and `burstgate keys ...`
    # (API keys, DB-direct bootstrap): controlplane/admin/cli.py.
    from controlplane.admin.cli import register as register_admin

    register_admin(app)
    # `burstgate export`, `price ...`, `margin` (issue 4): controlplane/ledger/cli.py.
    from controlplane.ledger.cli import register as register_ledger

    register_ledger(app)
    try:
        from controlplane.analysis.cli import register
    except ImportError as exc:  # only while the analysis package is absent
        if "controlplane.analysis" not in str(exc):
            raise
        return
    register(app)


_register_plugins()


def main() -> None:
    try:
        app()
    except DomainError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2)

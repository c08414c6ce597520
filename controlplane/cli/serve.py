"""``burstgate serve``, ``migrate`` and ``demo``."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from controlplane.cli.common import DbOpt, fail
from controlplane.cli.common import settings as load_settings


def migrate(database_url: DbOpt = None) -> None:
    """Create or upgrade the database schema (alembic upgrade head)."""
    from controlplane.store.db import upgrade

    url = load_settings(database_url=database_url).database_url
    upgrade(url)
    typer.echo("database at head")


# Exit status of `serve` and `demo` when another serve holds the database.
EXIT_REPLICA_LOCK_HELD = 3


def _serve(settings: Any) -> None:
    from controlplane import server
    from controlplane.store.replica_lock import ReplicaLockHeld
    from controlplane.telemetry import logs

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

    try:
        server.run(settings, on_ready=ready)
    except ReplicaLockHeld as exc:
        fail(str(exc), code=EXIT_REPLICA_LOCK_HELD)


def _refuse_if_served(database_url: str) -> None:
    """Fail now, before `demo` writes its tenants (or `serve --migrate`
    migrates) into a database another serve is serving, rather than once
    they are written. A probe: the server takes the lock for good at start."""
    from controlplane.store.replica_lock import ReplicaLockHeld, lock_for

    lock = lock_for(database_url)
    try:
        lock.acquire()
    except ReplicaLockHeld as exc:
        fail(str(exc), code=EXIT_REPLICA_LOCK_HELD)
    lock.release()


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
    settings = load_settings(
        host=host, port=port, metrics_port=metrics_port, database_url=database_url
    )
    if migrate_first:
        from controlplane.store.db import upgrade

        _refuse_if_served(settings.database_url)
        upgrade(settings.database_url)
    _serve(settings)


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
    from sqlalchemy.engine import make_url

    from controlplane import configfile
    from controlplane.store.config import ConfigRepository
    from controlplane.store.db import make_engine, upgrade

    settings = load_settings(port=port, database_url=database_url, admission_auth=admission_auth)
    _refuse_if_served(settings.database_url)
    upgrade(settings.database_url)
    engine = make_engine(settings.database_url)
    try:
        created, updated = configfile.apply(
            ConfigRepository(engine), configfile.load(configfile.DEMO_CONFIG)
        )
        _demo_prices(engine)
    finally:
        engine.dispose()
    shown = make_url(settings.database_url).render_as_string(hide_password=True)
    typer.echo(
        f"demo config: {created} tenants created, {updated} updated "
        f"({configfile.DEMO_CONFIG.name}); database {shown}"
    )
    _serve(settings)


def _demo_prices(engine: Any) -> None:
    """A default price-catalog entry, so the demo's ledger shows money (only
    when the catalog is empty: operators' prices are never overwritten)."""
    from decimal import Decimal as D

    from controlplane.domain.catalog import ANY, PriceEntry
    from controlplane.store.ledger import LedgerStore

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

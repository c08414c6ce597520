"""``burstgate serve``, ``migrate`` and ``demo``.

Each start runs its checks before it binds or writes anything (TLS files,
the listeners, the database and its schema: controlplane/startup), and a
failure before the "listening" line is one line on stderr (one JSON record
with BURSTGATE_LOG_FORMAT=json) with an exit status per class of failure
(controlplane/startup/errors.py; docs/operating.md, "Start-up failures")."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from controlplane.cli.common import DbOpt
from controlplane.startup.errors import Exit
from controlplane.startup.report import Start, failures, load_settings

# Exit status of `serve` and `demo` when another serve holds the database.
EXIT_REPLICA_LOCK_HELD = int(Exit.REPLICA_LOCK)

# Option names per settings field, for the settings error messages.
OPTIONS = {
    "host": "--host",
    "port": "--port",
    "metrics_port": "--metrics-port",
    "database_url": "--database-url",
}

HostOpt = Annotated[
    str | None,
    typer.Option(help="Overrides BURSTGATE_HOST (default 127.0.0.1).", show_default=False),
]
PortOpt = Annotated[
    int | None,
    typer.Option(help="Overrides BURSTGATE_PORT (default 50051; 0 = free port).",
                 show_default=False),
]  # fmt: skip
MetricsPortOpt = Annotated[
    int | None,
    typer.Option(
        help="Overrides BURSTGATE_METRICS_PORT (default 9464; 0 = free port, -1 = no /metrics).",
        show_default=False,
    ),
]


def migrate(database_url: DbOpt = None) -> None:
    """Create or upgrade the database schema (alembic upgrade head); a
    SQLite file is created, with its directory, if it does not exist."""
    from controlplane.startup.database import check_database
    from controlplane.store.db import upgrade

    settings = load_settings({"database_url": database_url}, OPTIONS)
    with failures(settings):
        check_database(settings, create=True)  # reachable, and not newer than this code
        upgrade(settings.database_url)
    typer.echo("database at head")


def _preflight(settings: Any, *, create: bool) -> None:
    """Everything checked before anything is bound or written."""
    from controlplane.startup.database import check_database
    from controlplane.startup.network import check_listeners
    from controlplane.startup.tls import check_tls

    check_tls(settings)
    check_listeners(settings)
    check_database(settings, create=create)


def _serve(start: Start) -> None:
    from controlplane import server

    settings = start.settings

    def ready(plane: server.ControlPlane) -> None:
        start.ready = True  # from here on a failure is not a start-up failure
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


def _refuse_if_served(database_url: str) -> None:
    """Fail now (ReplicaLockHeld: exit 3), before `demo` writes its tenants
    (or `serve --migrate` migrates) into a database another serve is
    serving, rather than once they are written. A probe: the server takes
    the lock for good at start."""
    from controlplane.store.replica_lock import lock_for

    lock = lock_for(database_url)
    lock.acquire()
    lock.release()


def serve(
    host: HostOpt = None,
    port: PortOpt = None,
    metrics_port: MetricsPortOpt = None,
    database_url: DbOpt = None,
    migrate_first: Annotated[
        bool,
        typer.Option(
            "--migrate/--no-migrate",
            help="Run migrations before serving (creating a SQLite database if need be).",
        ),
    ] = False,
) -> None:
    """Run the gRPC control plane until SIGTERM/SIGINT. The database must
    exist and be migrated (`burstgate migrate`, or --migrate)."""
    settings = load_settings(
        {"host": host, "port": port, "metrics_port": metrics_port, "database_url": database_url},
        OPTIONS,
    )
    with failures(settings) as start:
        _preflight(settings, create=migrate_first)
        if migrate_first:
            from controlplane.store.db import upgrade

            _refuse_if_served(settings.database_url)
            upgrade(settings.database_url)
        _serve(start)


def demo(
    host: HostOpt = None,
    port: PortOpt = None,
    metrics_port: MetricsPortOpt = None,
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
    """Migrate the database (creating it if need be), load the demo tenants
    and lanes, and serve."""
    from sqlalchemy.engine import make_url  # URL parsing only

    from controlplane import configfile
    from controlplane.store.config import ConfigRepository
    from controlplane.store.db import make_engine, upgrade

    settings = load_settings(
        {
            "host": host,
            "port": port,
            "metrics_port": metrics_port,
            "database_url": database_url,
            "admission_auth": admission_auth,
        },
        OPTIONS,
    )
    with failures(settings) as start:
        _preflight(settings, create=True)
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
        _serve(start)


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

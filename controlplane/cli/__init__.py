"""The ``burstgate`` command: one Typer app composed of the command modules
in this package (and the offline analysis commands)."""

from __future__ import annotations

from typing import Annotated

import typer
from burstgate_client.cli import sidecar

from controlplane.analysis.cli import register as register_analysis
from controlplane.cli import (
    admin,
    fakeengine,
    keys,
    ledger,
    loadtest,
    margin,
    replay,
    serve,
    simulate,
)
from controlplane.cli.config import config_app
from controlplane.cli.pools import pools_app
from controlplane.cli.pricing import pricing_app
from controlplane.cli.root import RootGroup
from controlplane.cli.tenant import tenant_app

app = typer.Typer(
    cls=RootGroup,
    help="burstgate: burst-aware admission control for multi-tenant LLM serving.",
    no_args_is_help=True,
    add_completion=False,
)


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"burstgate {version('burstgate')}")
        raise typer.Exit()


@app.callback()
def _root(
    _version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_print_version,
            is_eager=True,
            help="Print the version and exit.",
        ),
    ] = False,
) -> None:
    """burstgate: burst-aware admission control for multi-tenant LLM serving."""


app.command("migrate")(serve.migrate)
app.command("serve")(serve.serve)
app.command("demo")(serve.demo)
app.command("simulate")(simulate.simulate)
app.command("fake-engine")(fakeengine.fake_engine)
app.command("loadtest")(loadtest.loadtest)
app.command("replay")(replay.replay)
app.command("sidecar")(sidecar)  # burstgate-sidecar, from the client wing
app.add_typer(tenant_app, name="tenant")
app.add_typer(config_app, name="config")
# `burstgate tenant ...`: through the admin API or on the database (cli/tenant.py).
# `burstgate admin ...` (lanes, policy, audit, keys, state over the admin API)
# and `burstgate keys ...` (API keys, DB-direct bootstrap).
app.add_typer(admin.admin_app, name="admin")
app.add_typer(keys.keys_app, name="keys")
app.add_typer(pricing_app, name="pricing")  # `burstgate pricing show|windows` (gRPC)
app.add_typer(pools_app, name="pools")  # `burstgate pools status` (gRPC)
ledger.register(app)
app.command("margin")(margin.margin_command)
register_analysis(app)


def main() -> None:
    app()  # domain errors -> one line and exit 2: cli/root.py

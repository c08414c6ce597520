"""``burstgate config apply``: the declarative YAML config."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer

from controlplane.cli.common import DbOpt, settings

config_app = typer.Typer(help="Declarative YAML config (lanes and tenants).", no_args_is_help=True)


@contextlib.contextmanager
def _repo(database_url: str | None) -> Iterator[Any]:
    from controlplane.store.config import ConfigRepository
    from controlplane.store.db import make_engine

    engine = make_engine(settings(database_url=database_url).database_url)
    try:
        yield ConfigRepository(engine)
    finally:
        engine.dispose()


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

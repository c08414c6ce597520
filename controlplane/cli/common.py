"""Helpers every ``burstgate`` command module shares: settings from the
environment with command-line overrides, and the error exit."""

from __future__ import annotations

from typing import Annotated, Any, NoReturn

import typer
from pydantic import ValidationError

DbOpt = Annotated[
    str | None,
    typer.Option("--database-url", help="Overrides BURSTGATE_DATABASE_URL.", show_default=False),
]


def fail(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def settings(**overrides: Any) -> Any:
    from controlplane.settings import Settings

    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        first = exc.errors()[0]
        name = "BURSTGATE_" + str(first["loc"][0]).upper() if first["loc"] else "settings"
        fail(f"{name}: {first['msg']}")

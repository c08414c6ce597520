"""Helpers every ``burstgate`` command module shares: settings from the
environment with command-line overrides, and the error exit."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from pydantic import ValidationError

from controlplane.domain.errors import excerpt

DbOpt = Annotated[
    str | None,
    typer.Option("--database-url", help="Overrides BURSTGATE_DATABASE_URL.", show_default=False),
]


JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
UNLIMITED = ("unlimited", "none", "-")
DEFAULT_ADMIN_TARGET = "127.0.0.1:50051"

# The admin API connection (``burstgate admin`` and ``burstgate tenant --target``).
ApiKeyOpt = Annotated[
    str | None,
    typer.Option(envvar="BURSTGATE_API_KEY", help="An admin or viewer key.", show_default=False),
]
TlsCaOpt = Annotated[
    Path | None,
    typer.Option(envvar="BURSTGATE_ADMIN_TLS_CA", help="CA of the server cert (PEM)."),
]
TlsCertOpt = Annotated[
    Path | None, typer.Option(envvar="BURSTGATE_ADMIN_TLS_CERT", help="Client cert (mTLS).")
]
TlsKeyOpt = Annotated[
    Path | None, typer.Option(envvar="BURSTGATE_ADMIN_TLS_KEY", help="Client key (mTLS).")
]
TlsNameOpt = Annotated[
    str | None, typer.Option(help="Name to check the server certificate against.")
]
TimeoutOpt = Annotated[float, typer.Option(help="Seconds per call.")]


def connection(
    target: str,
    api_key: str | None,
    tls_ca: Path | None,
    tls_cert: Path | None,
    tls_key: Path | None,
    tls_server_name: str | None,
    timeout: float,
) -> dict[str, Any]:
    """The admin API connection options, as kept in ``ctx.obj``."""
    from burstgate_client.admin import TlsFiles

    tls = TlsFiles(tls_ca, tls_cert, tls_key, tls_server_name) if (tls_ca or tls_cert) else None
    return {"target": target, "api_key": api_key, "tls": tls, "timeout": timeout}


def connect_options(
    ctx: typer.Context,
    target: Annotated[
        str, typer.Option(envvar="BURSTGATE_ADMIN_TARGET", help="host:port of the server.")
    ] = DEFAULT_ADMIN_TARGET,
    api_key: ApiKeyOpt = None,
    tls_ca: TlsCaOpt = None,
    tls_cert: TlsCertOpt = None,
    tls_key: TlsKeyOpt = None,
    tls_server_name: TlsNameOpt = None,
    timeout: TimeoutOpt = 10.0,
) -> None:
    """The connection options of a command group that always talks to a
    server (``admin``, ``pricing``): register it as the group's callback."""
    ctx.obj = connection(target, api_key, tls_ca, tls_cert, tls_key, tls_server_name, timeout)


def fail(message: str, code: int = 2) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def to_dict(msg: Any) -> dict[str, Any]:
    from google.protobuf.json_format import MessageToDict

    d: dict[str, Any] = MessageToDict(msg, preserving_proto_field_name=True)
    return d


def echo_json(value: Any) -> None:
    typer.echo(json.dumps(value, indent=2, sort_keys=False))


@contextmanager
def admin_client(ctx: typer.Context) -> Iterator[Any]:
    """The AdminClient for the connection options; RPC errors -> exit 2."""
    import grpc
    from burstgate_client.admin import AdminClient

    opts: dict[str, Any] = ctx.obj or {}
    key = opts.get("api_key")
    if not key:
        fail("no API key: pass --api-key or set BURSTGATE_API_KEY "
              "(create one with `burstgate keys create --role admin`)")  # fmt: skip
    client = AdminClient(opts["target"], key, tls=opts.get("tls"), timeout=opts["timeout"])
    try:
        yield client
    except grpc.RpcError as exc:
        code = exc.code()
        name = code.name if code is not None else "UNKNOWN"
        fail(f"{name}: {exc.details()}")
    finally:
        client.close()


def parse_limit(value: str | None, name: str) -> tuple[bool, int | None]:
    """(given, value) for a limit option; 'unlimited' clears it."""
    if value is None:
        return False, None
    if value.strip().lower() in UNLIMITED:
        return True, None
    try:
        return True, int(value.replace("_", ""))
    except ValueError:
        fail(f"{name}: not an integer or 'unlimited': {excerpt(value)}")


def settings(**overrides: Any) -> Any:
    from controlplane.settings import Settings

    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        first = exc.errors()[0]
        name = "BURSTGATE_" + str(first["loc"][0]).upper() if first["loc"] else "settings"
        fail(f"{name}: {first['msg']}")

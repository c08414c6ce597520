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
# No server answered at the target: sysexits.h's EX_UNAVAILABLE, so that a
# script can tell "not running" from "refused my input" (2).
EXIT_UNREACHABLE = 69

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
    """The admin API connection options, as kept in ``ctx.obj``: each under
    its parameter's name, so that the same option given after the command
    (cli/lateopts.py) replaces it by name."""
    return {"target": target, "api_key": api_key, "tls_ca": tls_ca, "tls_cert": tls_cert,
            "tls_key": tls_key, "tls_server_name": tls_server_name,
            "timeout": timeout}  # fmt: skip


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
    """A message as ``--json`` prints it: proto3 JSON, except that 64-bit
    integers are JSON numbers.

    Proto3 JSON writes int64/uint64 as strings (for JavaScript, whose
    numbers are exact only to 2**53), so ``--json`` had ``"burst_tokens":
    "400"`` beside ``"max_concurrency": 50``. Every value burstgate keeps
    in an int64 (tokens, nano-dollars, Unix ns) is below 2**63 and Python,
    jq and most JSON readers keep such integers exactly; one number type for
    every integer field is what a script expects."""
    from google.protobuf.json_format import MessageToDict

    d: dict[str, Any] = MessageToDict(msg, preserving_proto_field_name=True)
    _int64_as_numbers(msg.DESCRIPTOR, d)
    return d


_INT64_TYPES = frozenset((3, 4, 6, 16, 18))  # INT64 UINT64 FIXED64 SFIXED64 SINT64
_MESSAGE = 11  # FieldDescriptor.TYPE_MESSAGE


def _int64_as_numbers(descriptor: Any, d: dict[str, Any]) -> None:
    """In place: the int64 fields of ``d`` (MessageToDict of a message of
    ``descriptor``), in nested and repeated messages and map values too."""
    for field in descriptor.fields:
        if field.name not in d:
            continue
        value = d[field.name]
        if field.type in _INT64_TYPES:
            d[field.name] = [int(v) for v in value] if isinstance(value, list) else int(value)
        elif field.type == _MESSAGE and isinstance(value, dict | list):
            sub = field.message_type
            if sub.GetOptions().map_entry and isinstance(value, dict):
                value_field = sub.fields_by_name["value"]
                if value_field.type in _INT64_TYPES:
                    d[field.name] = {k: int(v) for k, v in value.items()}
                elif value_field.type == _MESSAGE:
                    for v in value.values():
                        _nested(value_field.message_type, v)
            else:
                for v in value if isinstance(value, list) else [value]:
                    _nested(sub, v)


def _nested(descriptor: Any, value: Any) -> None:
    # Well-known types (Timestamp, Duration, FieldMask ...) have their own
    # JSON form (a string); only plain messages are walked.
    if isinstance(value, dict) and not descriptor.full_name.startswith("google.protobuf."):
        _int64_as_numbers(descriptor, value)


def echo_json(value: Any) -> None:
    typer.echo(json.dumps(value, indent=2, sort_keys=False))


def unreachable(target: str, what: str = "--target") -> str:
    """The one message for a server that does not answer at all (gRPC
    UNAVAILABLE before any answer): what to check, not a status code."""
    return (f"no burstgate server answered at {target} ({what}): is `burstgate serve` "
            "running at that HOST:PORT, and reachable from here?")  # fmt: skip


def check_target(target: str, option: str = "--target") -> None:
    """``target`` is HOST:PORT with a numeric port (an IPv6 host in [ ])."""
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        fail(f"{option}: expected HOST:PORT (e.g. 127.0.0.1:50051), got {excerpt(target)}")


@contextmanager
def admin_client(ctx: typer.Context) -> Iterator[Any]:
    """The AdminClient for the connection options; RPC errors -> exit 2,
    a server that does not answer -> :func:`unreachable`, exit 69
    (EX_UNAVAILABLE of sysexits.h; 2 stays "bad input"). Every
    command that talks to the admin API goes through here."""
    import grpc
    from burstgate_client.admin import AdminClient, TlsFiles

    opts: dict[str, Any] = ctx.obj or {}
    key = opts.get("api_key")
    if not key:
        fail("no API key: pass --api-key or set BURSTGATE_API_KEY "
              "(create one with `burstgate keys create --role admin`)")  # fmt: skip
    target = opts["target"]
    check_target(target)
    ca, cert = opts.get("tls_ca"), opts.get("tls_cert")
    tls = (TlsFiles(ca, cert, opts.get("tls_key"), opts.get("tls_server_name"))
           if (ca or cert) else None)  # fmt: skip
    client = AdminClient(target, key, tls=tls, timeout=opts["timeout"])
    try:
        yield client
    except grpc.RpcError as exc:
        code = exc.code()
        if code == grpc.StatusCode.UNAVAILABLE and _never_answered(exc):
            fail(unreachable(target), EXIT_UNREACHABLE)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            fail(f"DEADLINE_EXCEEDED: no answer from {target} within --timeout "
                 f"{opts['timeout']:g} s")  # fmt: skip
        name = code.name if code is not None else "UNKNOWN"
        fail(f"{name}: {exc.details()}")
    finally:
        client.close()


def _never_answered(exc: Any) -> bool:
    """UNAVAILABLE from the transport (nothing listening, refused, DNS,
    TLS handshake), not a server that answered UNAVAILABLE itself (e.g. its
    database is down: that message is the server's and is shown as is)."""
    details = (exc.details() or "").lower()
    return any(w in details for w in ("failed to connect", "connection refused", "dns",
                                      "connect failed", "handshake", "unreachable",
                                      "no address", "socket closed"))  # fmt: skip


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

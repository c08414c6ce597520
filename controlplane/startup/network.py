"""The gRPC and metrics listeners at start: each address is bound once and
released (a probe) before anything else happens, so a port in use is
reported in one line naming the option that moves it, before the database
is touched; grpc core would otherwise print its own error lines first. The
real binds later still fail cleanly (``port_error``) if something takes the
port in between."""

from __future__ import annotations

import errno
import socket

from controlplane.settings import Settings
from controlplane.startup.errors import (
    GRPC_PORT_OPTION,
    HOST_OPTION,
    METRICS_PORT_OPTION,
    Exit,
    StartupError,
)


def address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def check_listeners(settings: Settings) -> None:
    """Raise a StartupError when the gRPC port, or the metrics port unless
    /metrics is off, cannot be bound on ``settings.host``."""
    host, port, metrics = settings.host, settings.port, settings.metrics_port
    if metrics > 0 and metrics == port:
        raise StartupError(
            Exit.LISTENER, "ports_clash",
            f"the gRPC and metrics ports are both {port}",
            f"give them different ports ({GRPC_PORT_OPTION}, {METRICS_PORT_OPTION})",
        )  # fmt: skip
    failure = probe(host, port)
    if failure is not None:
        raise port_error("gRPC", host, port, failure)
    if metrics >= 0:
        failure = probe(host, metrics)
        if failure is not None:
            raise port_error("metrics", host, metrics, failure)


def probe(host: str, port: int) -> OSError | None:
    """Bind ``host:port`` and let it go, as the servers bind it
    (SO_REUSEADDR; it binds when any address the host resolves to does);
    the error of the first address when none does."""
    try:
        infos = socket.getaddrinfo(
            host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        return exc
    first: OSError | None = None
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(addr)
            except OSError as exc:
                first = first or exc
                continue
        return None
    return first


def port_error(what: str, host: str, port: int, exc: OSError | None) -> StartupError:
    """The one line for a listener that cannot be bound: ``what`` is "gRPC"
    or "metrics"; ``exc`` the bind's error when known."""
    where = address(host, port)
    option = GRPC_PORT_OPTION if what == "gRPC" else METRICS_PORT_OPTION
    off = "" if what == "gRPC" else ", or -1 to turn /metrics off"
    key = what.lower()
    if isinstance(exc, socket.gaierror):
        return StartupError(
            Exit.LISTENER, "host_unresolvable",
            f"cannot resolve the host {host!r} to listen for {what} on: {exc.strerror}",
            f"set {HOST_OPTION} to an address or name of this machine",
        )  # fmt: skip
    code = exc.errno if exc is not None else None
    if code == errno.EADDRINUSE:
        return StartupError(
            Exit.LISTENER, f"{key}_port_in_use",
            f"the {what} port {where} is already in use",
            f"stop what holds it, or choose another port with {option} (0 = any free port){off}",
        )  # fmt: skip
    if code == errno.EACCES:
        return StartupError(
            Exit.LISTENER, f"{key}_port_not_permitted",
            f"not allowed to listen for {what} on {where} (ports below 1024 need root or "
            "CAP_NET_BIND_SERVICE)",
            f"choose a port of 1024 or more with {option}{off}",
        )  # fmt: skip
    if code == errno.EADDRNOTAVAIL:
        return StartupError(
            Exit.LISTENER, "host_not_local",
            f"cannot listen for {what} on {where}: {host} is not an address of this machine",
            f"set {HOST_OPTION} to one of its addresses (0.0.0.0 = all of them)",
        )  # fmt: skip
    detail = (exc.strerror or str(exc)) if exc is not None else "the address cannot be bound"
    return StartupError(
        Exit.LISTENER, f"{key}_port_unavailable",
        f"cannot listen for {what} on {where}: {detail}",
        f"check {HOST_OPTION} and {option}{off}",
    )  # fmt: skip

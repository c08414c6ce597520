"""``burstgate-sidecar`` (and ``burstgate sidecar``, the same command in the
server's CLI): the HTTP sidecar in front of an OpenAI-compatible engine
(docs/sidecar.md).

Outside the ``sidecar`` package, which it imports only when the command
runs: the server's CLI registers this command, and every ``burstgate``
command would otherwise pay for the sidecar's HTTP stack at start."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Annotated, NoReturn

import typer


def fail(message: str, code: int = 2) -> NoReturn:
    """As every burstgate command fails: ``error: ...`` on stderr, exit 2
    for bad input (7: the port cannot be bound)."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)



def sidecar(
    upstream: Annotated[
        str | None, typer.Option(help="The engine's origin, e.g. http://127.0.0.1:8000.")
    ] = None,
    control_plane: Annotated[
        str | None,
        typer.Option(envvar="BURSTGATE_TARGET", help="host:port of burstgate's admission API."),
    ] = None,
    config: Annotated[
        Path | None, typer.Option(help="YAML: tenants, lanes, metrics (docs/sidecar.md).")
    ] = None,
    host: Annotated[
        str | None, typer.Option(help="Address to listen on (default 127.0.0.1).")
    ] = None,
    port: Annotated[
        int | None, typer.Option(min=0, max=65535, help="Port, 0 = any free port (default 8080).")
    ] = None,
    pool: Annotated[str | None, typer.Option(help="The engine's pool (default: default).")] = None,
    api_key: Annotated[
        str | None,
        typer.Option(envvar="BURSTGATE_API_KEY", help="A sidecar key, when admission auth is on."),
    ] = None,
    default_tenant: Annotated[
        str | None, typer.Option(help="The tenant of requests with no known key or header.")
    ] = None,
    tokenizer: Annotated[
        Path | None, typer.Option(help="A tokenizer.json for prompt counts (the tokenizer extra).")
    ] = None,
    spool: Annotated[
        Path | None,
        typer.Option(help="The completion spool's file (default: under $STATE_DIRECTORY or "
                     "the working directory)."),
    ] = None,
    no_spool: Annotated[
        bool,
        typer.Option("--no-spool", help="No completion spool: Completes not delivered at "
                     "shutdown are lost."),
    ] = False,
    access_log: Annotated[
        str | None,
        typer.Option(envvar="BURSTGATE_SIDECAR_ACCESS_LOG",
                     help="One JSON line per request, to this file ('-': stdout)."),
    ] = None,
    tls_ca: Annotated[
        Path | None,
        typer.Option(envvar="BURSTGATE_SIDECAR_TLS_CA",
                     help="TLS to the control plane: the CA that signed its certificate."),
    ] = None,
    tls_cert: Annotated[
        Path | None,
        typer.Option(envvar="BURSTGATE_SIDECAR_TLS_CERT",
                     help="mTLS: this sidecar's certificate (with --tls-key)."),
    ] = None,
    tls_key: Annotated[
        Path | None,
        typer.Option(envvar="BURSTGATE_SIDECAR_TLS_KEY", help="mTLS: this sidecar's key."),
    ] = None,
    tls_server_name: Annotated[
        str | None,
        typer.Option(help="The name to check the control plane's certificate against."),
    ] = None,
) -> None:
    """Serve the OpenAI API in front of an engine: every completion is
    admitted by burstgate first (refused: 429 with retry-after and
    x-ratelimit-* headers), forwarded, and settled with the engine's usage;
    the engine's /metrics go to burstgate as load reports. SIGTERM drains
    the requests in flight."""
    import asyncio
    import signal

    from burstgate_client.errors import InvalidArgument
    from burstgate_client.sidecar import Sidecar, load
    from burstgate_client.sidecar.config import spool_line

    try:
        cfg = load(config, upstream=upstream, control_plane=control_plane, host=host, port=port,
                   pool=pool, control_plane_api_key=api_key, default_tenant=default_tenant,
                   tokenizer=tokenizer, spool_path=spool, spool=False if no_spool else None,
                   access_log=access_log, control_plane_tls_ca=tls_ca,
                   control_plane_tls_cert=tls_cert, control_plane_tls_key=tls_key,
                   control_plane_tls_server_name=tls_server_name)  # fmt: skip
    except InvalidArgument as exc:
        fail(str(exc))

    async def main() -> None:
        from burstgate_client.sidecar.sdkclient import sdk_client

        try:
            admitter = sdk_client(cfg)
        except InvalidArgument as exc:
            fail(str(exc))
        try:
            server = Sidecar(cfg, admitter)
        except InvalidArgument as exc:
            await admitter.aclose()
            fail(str(exc))
        try:
            bound = await server.start()
        except OSError as exc:
            await admitter.aclose()
            fail(f"--port: cannot listen on {cfg.host}:{cfg.port}: {exc.strerror or exc}", 7)
        typer.echo(
            f"burstgate sidecar listening on http://{cfg.host}:{bound}/v1 (engine "
            f"{cfg.upstream}, control plane {cfg.control_plane}"
            f"{' over TLS' if cfg.tls_files() else ''}, pool {cfg.pool})",
            err=True,
        )
        typer.echo(spool_line(admitter.spool_file), err=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
            typer.echo("draining the requests in flight ...", err=True)
        finally:
            await server.stop()
            await admitter.aclose()

    with contextlib.suppress(KeyboardInterrupt):
        if sys.platform != "win32":
            import uvloop

            uvloop.run(main())
        else:  # pragma: no cover
            asyncio.run(main())


def main() -> None:
    """The ``burstgate-sidecar`` console script: this one command."""
    typer.run(sidecar)

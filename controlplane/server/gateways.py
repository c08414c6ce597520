"""The server's doors, each built from settings before the database is
read (a bad file fails the start first): TLS credentials, the interceptors,
Envoy's rate-limit service with its owner gate, and the /metrics server."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import grpc
from prometheus_client import start_http_server

from controlplane.auth import KeyCache
from controlplane.domain.errors import InvalidArgument
from controlplane.ha.serving import Ownership
from controlplane.ledger.metering import Metering
from controlplane.rpc.dbcall import DbCaller
from controlplane.rpc.interceptor import ServerInterceptor
from controlplane.service import AdmissionService
from controlplane.service.waiting import WaitingRoom
from controlplane.settings import Settings
from controlplane.startup.errors import Exit, StartupError
from controlplane.startup.network import port_error
from controlplane.telemetry import tracing
from controlplane.telemetry.metrics import RpcStats, registry_for
from controlplane.telemetry.tenant_metrics import TenantLabels

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

    from controlplane.integrations.envoy.servicer import RateLimitServicer


def interceptors(
    settings: Settings, key_cache: KeyCache, db: DbCaller, stats: RpcStats
) -> tuple[list[grpc.aio.ServerInterceptor], Any]:
    """The server's interceptors, outermost first, and the tracer provider
    to shut down at stop (None without tracing)."""
    out: list[grpc.aio.ServerInterceptor] = []
    tracer_provider: Any = None
    if settings.tracing != "off":
        traced, tracer_provider = tracing.server_interceptor(settings)
        out.append(traced)  # outermost: the span covers auth too
    out.append(
        ServerInterceptor(
            key_cache=key_cache,
            db=db,
            stats=stats,
            admission_auth=settings.admission_auth,
            admission_log_sample=settings.admission_log_sample,
        )
    )
    return out, tracer_provider


def credentials(s: Settings) -> grpc.ServerCredentials | None:
    """The TLS credentials (``startup.tls`` checked the files first in
    the CLI; a file that fails here is still one line, exit 8)."""
    if s.tls_cert_file is None or s.tls_key_file is None:
        return None
    try:
        pair = [(s.tls_key_file.read_bytes(), s.tls_cert_file.read_bytes())]
        ca = s.tls_client_ca_file.read_bytes() if s.tls_client_ca_file else None
    except OSError as exc:
        raise StartupError(
            Exit.TLS, "tls_file_unusable", f"cannot read TLS file {exc.filename}: "
            f"{exc.strerror}", "check BURSTGATE_TLS_CERT_FILE, _KEY_FILE and _CLIENT_CA_FILE",
        ) from exc  # fmt: skip
    if ca is None:
        return grpc.ssl_server_credentials(pair)
    return grpc.ssl_server_credentials(pair, root_certificates=ca, require_client_auth=True)


def envoy_rls(
    settings: Settings,
    service: AdmissionService,
    waiting: WaitingRoom,
    ownership: Ownership,
    metering: Metering | None,
    collectors: list[Collector],
) -> RateLimitServicer | None:
    """Envoy's rate-limit service when configured (docs/envoy.md); a
    mapping file that cannot be read or validated fails the start. Its
    owner gate (forward.py) forwards calls for a cell another replica
    owns to it, and is inactive on a single replica; the gate's collector
    is added to ``collectors``."""
    path = settings.envoy_rls_config
    if path is None:
        return None
    # Imported only when configured: the Envoy protos stay out of a server
    # that does not serve them.
    from controlplane.integrations.envoy.config import LiveConfig
    from controlplane.integrations.envoy.forward import OwnerGate, peer_credentials
    from controlplane.integrations.envoy.servicer import RateLimitServicer

    try:
        live = LiveConfig(path)
    except InvalidArgument as exc:
        raise StartupError(
            Exit.SETTINGS, "envoy_rls_config_invalid", f"BURSTGATE_ENVOY_RLS_CONFIG: {exc}",
            "fix the file (docs/envoy.md, \"Descriptor mapping\")",
        ) from exc  # fmt: skip
    cert, key, ca = (
        p.read_bytes() if p is not None else None
        for p in (settings.tls_cert_file, settings.tls_key_file, settings.tls_client_ca_file)
    )
    gate = OwnerGate(ownership, service, credentials=peer_credentials(cert, key, ca))
    collectors.append(gate.collector())
    return RateLimitServicer(service, live, waiting, metering=metering, gate=gate)


def serve_metrics(
    settings: Settings,
    service: AdmissionService,
    collectors: Sequence[Collector],
    tenant_labels: TenantLabels,
) -> Any:
    """The /metrics HTTP server (None when ``metrics_port`` is negative);
    a port in use fails the start."""
    if settings.metrics_port < 0:
        return None
    try:
        httpd, _ = start_http_server(
            settings.metrics_port,
            addr=settings.host,
            registry=registry_for(service, *collectors, tenant_labels=tenant_labels),
        )
    except OSError as exc:
        raise port_error("metrics", settings.host, settings.metrics_port, exc) from None
    return httpd


def close_metrics(httpd: Any) -> None:
    if httpd is not None:
        httpd.shutdown()
        httpd.server_close()

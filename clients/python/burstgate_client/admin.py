"""Clients for an authenticated burstgate: the admin API client the CLI and
tests use, and a channel that sends a sidecar token on every call.

    with AdminClient("127.0.0.1:50051", api_key) as admin:
        admin.stub.ListTenants(apb.ListTenantsRequest(), **admin.call_kw)

    channel = authenticated_channel("127.0.0.1:50051", sidecar_token)
    AdmissionServiceStub(channel).Admit(...)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple

import grpc

from burstgate_client._proto.burstgate.v1 import admin_pb2 as apb
from burstgate_client._proto.burstgate.v1 import admin_pb2_grpc as apb_grpc
from burstgate_client.protoclient import KEEPALIVE_OPTIONS

__all__ = ["AdminClient", "TlsFiles", "apb", "authenticated_channel"]


class TlsFiles(NamedTuple):
    """PEM files: the CA that signed the server's certificate, and for mTLS
    the client's certificate and key. ``server_name`` overrides the name
    checked against the server certificate."""

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    server_name: str | None = None


def _channel(target: str, tls: TlsFiles | None) -> grpc.Channel:
    if tls is None or (tls.ca is None and tls.cert is None):
        return grpc.insecure_channel(target, options=KEEPALIVE_OPTIONS)
    creds = grpc.ssl_channel_credentials(
        root_certificates=tls.ca.read_bytes() if tls.ca else None,
        private_key=tls.key.read_bytes() if tls.key else None,
        certificate_chain=tls.cert.read_bytes() if tls.cert else None,
    )
    options: list[tuple[str, Any]] = list(KEEPALIVE_OPTIONS)
    if tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return grpc.secure_channel(target, creds, options=options)


class _BearerAuth(
    grpc.UnaryUnaryClientInterceptor,  # type: ignore[misc]
    grpc.UnaryStreamClientInterceptor,  # type: ignore[misc]
    grpc.StreamUnaryClientInterceptor,  # type: ignore[misc]
    grpc.StreamStreamClientInterceptor,  # type: ignore[misc]
):
    """Adds ``authorization: Bearer <key>`` to every call, of every shape
    (ExportLedger is server-streaming, AdmitStream bidirectional)."""

    def __init__(self, key: str) -> None:
        self._md = ("authorization", f"Bearer {key}")

    def _details(self, details: Any) -> Any:
        metadata = [*(details.metadata or ()), self._md]
        return details._replace(metadata=metadata)

    def intercept_unary_unary(
        self, continuation: Callable[[Any, Any], Any], details: Any, request: Any
    ) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(
        self, continuation: Callable[[Any, Any], Any], details: Any, request: Any
    ) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(
        self, continuation: Callable[[Any, Any], Any], details: Any, request_iterator: Any
    ) -> Any:
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(
        self, continuation: Callable[[Any, Any], Any], details: Any, request_iterator: Any
    ) -> Any:
        return continuation(self._details(details), request_iterator)


def authenticated_channel(target: str, key: str, tls: TlsFiles | None = None) -> grpc.Channel:
    """A channel that sends ``key`` (a sidecar token or API key) on every call."""
    return grpc.intercept_channel(_channel(target, tls), _BearerAuth(key))


class AdminClient:
    def __init__(
        self,
        target: str,
        api_key: str,
        *,
        tls: TlsFiles | None = None,
        timeout: float | None = 10.0,
    ) -> None:
        self.channel = _channel(target, tls)
        self.stub = apb_grpc.AdminServiceStub(self.channel)
        self.call_kw: dict[str, Any] = {
            "metadata": (("authorization", f"Bearer {api_key}"),),
            "timeout": timeout,
        }

    def call(self, method: str, request: Any) -> Any:
        """``stub.<method>(request)`` with credentials and timeout."""
        return getattr(self.stub, method)(request, **self.call_kw)

    def list_tenants(self, page_size: int = 0) -> list[apb.Tenant]:
        """Every tenant, following next_page_token."""
        out: list[apb.Tenant] = []
        token = ""
        while True:
            resp = self.call(
                "ListTenants", apb.ListTenantsRequest(page_size=page_size, page_token=token)
            )
            out.extend(resp.tenants)
            token = resp.next_page_token
            if not token:
                return out

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

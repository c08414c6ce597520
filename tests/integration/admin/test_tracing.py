"""OpenTelemetry tracing (the optional ``otel`` extra): a server span per RPC
that continues the sidecar's ``traceparent``."""

from __future__ import annotations

import functools
from typing import Any

import grpc
import pytest
from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
from burstgate_client._proto.burstgate.v1 import admission_pb2_grpc as pb_grpc

from controlplane.store.db import upgrade
from tests.integration.admin.conftest import start_server
from tests.support import add_tenants

memory = pytest.importorskip("opentelemetry.sdk.trace.export.in_memory_span_exporter")

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


def test_server_span_continues_the_sidecar_trace(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from decimal import Decimal

    from controlplane.domain import TenantConfig
    from controlplane.telemetry import tracing

    upgrade(sqlite_url)
    add_tenants(sqlite_url, TenantConfig("acme", Decimal(100), 1000))
    exporter: Any = memory.InMemorySpanExporter()
    monkeypatch.setattr(
        tracing,
        "server_interceptor",
        functools.partial(tracing.server_interceptor, exporter=exporter),
    )
    srv = start_server(sqlite_url, tracing="console")
    try:
        stub = pb_grpc.AdmissionServiceStub(grpc.insecure_channel(srv.target))
        r = stub.Admit(
            pb.AdmitRequest(tenant_id="acme", request_id="t1", prompt_tokens=10),
            metadata=(("traceparent", f"00-{TRACE_ID}-{PARENT_ID}-01"),),
            timeout=10,
        )
        assert r.decision == pb.DECISION_ADMIT
    finally:
        srv.stop()
    spans = [s for s in exporter.get_finished_spans() if s.name.endswith("/Admit")]
    assert len(spans) == 1
    span = spans[0]
    assert format(span.context.trace_id, "032x") == TRACE_ID
    assert span.parent is not None and format(span.parent.span_id, "016x") == PARENT_ID
    assert span.resource.attributes["service.name"] == "burstgate"


def test_tracing_off_by_default_needs_no_extra() -> None:
    from controlplane.settings import Settings

    assert Settings().tracing == "off"

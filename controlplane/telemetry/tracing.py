"""Optional OpenTelemetry tracing of the gRPC server (the ``otel`` extra).

Off by default. With ``BURSTGATE_TRACING=console`` spans are printed to
stderr; with ``otlp`` they go to ``BURSTGATE_OTLP_ENDPOINT`` (an OpenTelemetry
collector). Nothing leaves the process unless configured. The server span
continues the trace of a sidecar that sends W3C ``traceparent`` metadata.
"""

from __future__ import annotations

from typing import Any

from controlplane.settings import Settings


class TracingUnavailable(RuntimeError):
    pass


def server_interceptor(settings: Settings, *, exporter: Any = None) -> tuple[Any, Any]:
    """(grpc.aio server interceptor, tracer provider) for ``settings.tracing``;
    ``exporter`` overrides the configured one (tests pass an in-memory one)."""
    try:
        # The otel extra may be absent where mypy runs: hence the ignores.
        from opentelemetry.instrumentation.grpc import (  # type: ignore[import-not-found,unused-ignore]
            aio_server_interceptor,
        )
        from opentelemetry.sdk.resources import (  # type: ignore[import-not-found,unused-ignore]
            Resource,
        )
        from opentelemetry.sdk.trace import (  # type: ignore[import-not-found,unused-ignore]
            TracerProvider,
        )
        from opentelemetry.sdk.trace.export import (  # type: ignore[import-not-found,unused-ignore]
            BatchSpanProcessor,
            ConsoleSpanExporter,
            SimpleSpanProcessor,
        )
    except ImportError as exc:
        raise TracingUnavailable(
            f"BURSTGATE_TRACING={settings.tracing} needs the otel extra: "
            f"pip install 'burstgate[otel]' ({exc})"
        ) from exc
    provider = TracerProvider(
        resource=Resource.create({"service.name": settings.tracing_service_name})
    )
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    elif settings.tracing == "console":
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    elif settings.tracing == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # type: ignore[import-not-found,unused-ignore]
                OTLPSpanExporter,
            )
        except ImportError as exc:
            raise TracingUnavailable(
                "BURSTGATE_TRACING=otlp needs opentelemetry-exporter-otlp-proto-grpc "
                f"(the otel extra) ({exc})"
            ) from exc
        provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=settings.otlp_endpoint))
        )
    interceptor = aio_server_interceptor(  # type: ignore[no-untyped-call,unused-ignore]
        tracer_provider=provider
    )
    return interceptor, provider

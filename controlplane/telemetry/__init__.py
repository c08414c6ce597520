"""Observability adapters: Prometheus collectors (admission, RPCs, ledger),
the live per-tenant sampler, OpenTelemetry tracing and log configuration."""

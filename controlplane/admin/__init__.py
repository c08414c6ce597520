"""The operator side of burstgate: the admin gRPC API (a second adapter over
the same service layer as the admission API), API keys and per-sidecar
tokens, the audit log, the server interceptor (auth, access logs, RPC
metrics), optional OpenTelemetry tracing, and the ``burstgate admin`` /
``burstgate keys`` CLI commands."""

"""The sidecar's own Prometheus metrics (its ``GET /metrics``), in a
registry of its own, not the process's default one."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Admission waits run from a fraction of a millisecond (answered at once) to
# the lanes' max waits (seconds, held in the gate).
ADMIT_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                 5.0, 10.0, 30.0)  # fmt: skip


class SidecarMetrics:
    def __init__(self, pending: Callable[[], float]) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "burstgate_sidecar_requests", "Completion requests by outcome: admitted (forwarded), "
            "offline (admitted locally, control plane unreachable), refused, unavailable "
            "(fail-closed), bad_request.", ("outcome",), registry=r,
        )  # fmt: skip
        self.refusals = Counter(
            "burstgate_sidecar_refusals", "Refusals by reason.", ("reason",), registry=r
        )
        self.admit_seconds = Histogram(
            "burstgate_sidecar_admit_seconds",
            "Time from the request's arrival to the admission (held in the gate included).",
            buckets=ADMIT_BUCKETS, registry=r,
        )  # fmt: skip
        self.upstream = Counter(
            "burstgate_sidecar_upstream_responses", "Engine answers to forwarded completion "
            "requests by status class (2xx, 4xx, 5xx; error = no answer).", ("status",),
            registry=r,
        )  # fmt: skip
        self.disconnects = Counter(
            "burstgate_sidecar_client_disconnects",
            "Clients that went away before the answer ended (the engine's request cancelled).",
            registry=r,
        )  # fmt: skip
        self.settlements = Counter(
            "burstgate_sidecar_settlements", "Completes: delivered, buffered (delivered later) "
            "or failed.", ("result",), registry=r,
        )  # fmt: skip
        self.passthrough = Counter(
            "burstgate_sidecar_passthrough_requests", "Requests to other paths, forwarded as "
            "they are.", registry=r,
        )  # fmt: skip
        self.inflight = Gauge(
            "burstgate_sidecar_inflight_requests", "Requests being served now.", registry=r
        )
        self.load_reports = Counter(
            "burstgate_sidecar_load_reports", "Engine scrapes: sent, unreachable (the control "
            "plane), rejected (by it), scrape_failed (the engine's /metrics), no_queue_depth.",
            ("result",), registry=r,
        )  # fmt: skip
        pending_gauge = Gauge(
            "burstgate_sidecar_pending_completions",
            "Completes buffered while the control plane is unreachable.", registry=r,
        )  # fmt: skip
        pending_gauge.set_function(pending)

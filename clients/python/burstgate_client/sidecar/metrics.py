"""The sidecar's own Prometheus metrics (its ``GET /metrics``), in a
registry of its own, not the process's default one.

Every label value the sidecar can set is created at start (at 0), so that
a fresh sidecar's page has every series a dashboard panel or an alert
reads: ``rate()`` of a series that appears only with its first event
misses that event, and a panel over no series shows "No data" rather than
a flat zero. The ``_created`` series (prometheus_client's creation
timestamp of each counter and histogram child) are left out of the page
(``exposition()``): dashboards and alerts do not use them, and they double
the page. Not ``prometheus_client.disable_created_metrics()``: it is
process-wide, and a sidecar also runs inside other processes (the load
generator's ``--via-sidecar``, tests beside a control plane) whose pages
must stay as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric

from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb

# Admission waits run from a fraction of a millisecond (answered at once) to
# the lanes' max waits (seconds, held in the gate).
ADMIT_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                 5.0, 10.0, 30.0)  # fmt: skip
# What the sidecar adds to a request on its way in: ~0.1 ms of its own work
# (bench/bench_sidecar.py) plus the Admit's round trip to the control plane.
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1,
                    0.25, 0.5, 1.0)  # fmt: skip

OUTCOMES = ("admitted", "offline", "refused", "unavailable", "bad_request")
# burstgate's refusal reasons (the proto's Reason names, as the SDK spells
# them), the SDK's "unavailable" (fail-closed) and "unknown" (no reason).
REASONS = (
    *(n.removeprefix("REASON_").lower() for n in pb.Reason.keys() if n != "REASON_UNSPECIFIED"),  # noqa: SIM118 (an enum wrapper, not a dict)
    "unavailable", "unknown",
)  # fmt: skip
UPSTREAM_STATUSES = ("1xx", "2xx", "3xx", "4xx", "5xx", "error")
SETTLEMENTS = ("delivered", "buffered", "failed")
LOAD_REPORTS = ("sent", "unreachable", "rejected", "scrape_failed", "no_queue_depth")


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
        self.overhead_seconds = Histogram(
            "burstgate_sidecar_overhead_seconds",
            "What the sidecar adds before an admitted request reaches the engine: from its "
            "arrival to its forwarding, less the time burstgate's gate held it (the request's "
            "reading, token count, the Admit's round trip, the rewrite).",
            buckets=OVERHEAD_BUCKETS, registry=r,
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
        for counter, values in ((self.requests, OUTCOMES), (self.refusals, REASONS),
                                (self.upstream, UPSTREAM_STATUSES),
                                (self.settlements, SETTLEMENTS),
                                (self.load_reports, LOAD_REPORTS)):  # fmt: skip
            for value in values:
                counter.labels(value)

    def exposition(self) -> _WithoutCreated:
        """The registry as /metrics serves it (for ``generate_latest``)."""
        return _WithoutCreated(self.registry)


class _WithoutCreated:
    """A registry's families without their ``_created`` samples."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterable[Metric]:
        for family in self._registry.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family

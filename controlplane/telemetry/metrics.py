"""Prometheus metrics read from the service at scrape time.

The admission path only bumps plain ints in the service
(``service.stats``); this collector turns them into metric families when
Prometheus scrapes, so a decision pays no metrics-library cost.

Other modules contribute collectors: anything with ``collect()`` yielding
metric families (``prometheus_client.registry.Collector``) is passed to
``registry_for(service, *extra)``; ``ControlPlane.metrics_collectors`` is the
list the server registers at start, so a package appends its collector there
(or to ``EXTRA_COLLECTORS`` below, for collectors built from the plane).
Collectors run on the HTTP server's thread: read plain values that the
event loop publishes, never call into the fast path from ``collect()``.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector, CollectorRegistry

from controlplane.domain import Decision
from controlplane.service import AdmissionService
from controlplane.service.admission import QUEUE_WAIT_BUCKETS_NS
from fastpath import Reason


class AdmissionCollector(Collector):
    def __init__(self, service: AdmissionService) -> None:
        self._svc = service

    def collect(self) -> Iterator[Metric]:
        info = InfoMetricFamily("burstgate_fastpath", "Which fast-path implementation is live")
        info.add_metric([], {"implementation": self._svc.implementation})
        yield info
        decisions = CounterMetricFamily(
            "burstgate_decisions",
            "Admission decisions by outcome and reason",
            labels=["decision", "reason"],
        )
        for (decision, reason), n in sorted(self._svc.stats.decision_counts.items()):
            decisions.add_metric([Decision(decision).name.lower(), Reason(reason).name.lower()], n)
        yield decisions
        yield GaugeMetricFamily(
            "burstgate_open_reservations",
            "Admitted requests not yet settled",
            value=self._svc.open_reservations,
        )
        # Memory protection's caps (settings, fixed at start): alert on the
        # open count nearing the overall one before Admits are refused.
        settings = self._svc.settings
        caps = GaugeMetricFamily(
            "burstgate_open_reservations_limit",
            "Most open reservations held before Admit answers OPEN_RESERVATIONS "
            "(scope overall or per tenant; 0 = no cap)",
            labels=["scope"],
        )
        caps.add_metric(["overall"], settings.max_open_reservations)
        caps.add_metric(["tenant"], settings.max_open_reservations_per_tenant)
        yield caps
        yield CounterMetricFamily(
            "burstgate_reservations_expired",
            "Reservations released by the TTL without a Complete",
            value=self._svc.stats.expired_total,
        )
        yield from self._queues()

    def _queues(self) -> Iterator[Metric]:
        svc = self._svc
        depth = GaugeMetricFamily(
            "burstgate_queue_waiting", "Admit calls waiting in each lane's queue", labels=["lane"]
        )
        for lane, n in sorted(svc.queue_depths().items()):
            depth.add_metric([lane], n)
        yield depth
        waits = HistogramMetricFamily(
            "burstgate_queue_wait_seconds",
            "Time Admit calls waited in a lane's queue (admitted or timed out)",
            labels=["lane"],
        )
        bounds = [ns / 1e9 for ns in QUEUE_WAIT_BUCKETS_NS]
        for lane, counts in sorted(svc.stats.queue_wait_buckets.items()):
            counts = list(counts)  # a copy: the event loop keeps counting
            cumulative, total = [], 0
            for le, c in zip([*map(str, bounds), "+Inf"], counts, strict=True):
                total += c
                cumulative.append((le, float(total)))
            waits.add_metric([lane], cumulative, svc.stats.queue_wait_sum_ns[lane] / 1e9)
        yield waits
        yield CounterMetricFamily(
            "burstgate_queue_cancelled",
            "Waiting Admit calls whose caller went away",
            value=svc.stats.cancelled_total,
        )
        shadow = CounterMetricFamily(
            "burstgate_shadow_refusals",
            "Shadow mode: requests admitted that would have been refused, by reason",
            labels=["reason"],
        )
        for reason, n in sorted(svc.stats.shadow_counts.items()):
            shadow.add_metric([Reason(reason).name.lower()], n)
        yield shadow


def registry_for(service: AdmissionService, *extra: Collector) -> CollectorRegistry:
    """A registry with the admission collector, the process's own metrics
    (``process_resident_memory_bytes``, CPU, open fds: prometheus_client's
    ProcessCollector, which only its default registry has otherwise) and
    any ``extra`` collectors."""
    registry = CollectorRegistry()
    registry.register(AdmissionCollector(service))
    ProcessCollector(registry=registry)
    for collector in extra:
        registry.register(collector)
    return registry


# --- Shared building blocks: plain-int histograms and RPC stats ---

# Sub-millisecond buckets: a unary Admit costs ~0.45 ms of server CPU, a
# decision in the fast path tens of nanoseconds. Seconds, Prometheus style.
LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0025, 0.005,
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip


class LatencyHistogram:
    """A histogram as plain ints, observed on the event-loop thread (a bisect
    and two additions; no lock, no prometheus-client call) and turned into a
    metric family at scrape time."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float] = LATENCY_BUCKETS_S) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.total += seconds

    def buckets(self) -> tuple[list[tuple[str, float]], float]:
        """Cumulative buckets (as Prometheus wants them) and the sum."""
        counts = list(self.counts)  # one consistent copy
        out: list[tuple[str, float]] = []
        acc = 0
        for bound, n in zip((*self.bounds, float("inf")), counts, strict=True):
            acc += n
            out.append(("+Inf" if bound == float("inf") else repr(bound), acc))
        return out, self.total


class RpcStats:
    """Per-RPC counters the server interceptor bumps (plain dict entries)."""

    def __init__(self) -> None:
        # (service, method, status code name) -> calls
        self.handled: Counter[tuple[str, str, str]] = Counter()
        # method -> latency of admission decisions (Admit per call,
        # AdmitStream per batch), measured inside the server.
        self.decision_latency: dict[str, LatencyHistogram] = {}
        # reason (missing, invalid, forbidden) -> refused calls
        self.auth_failures: Counter[str] = Counter()

    def histogram(self, method: str) -> LatencyHistogram:
        h = self.decision_latency.get(method)
        if h is None:
            h = self.decision_latency[method] = LatencyHistogram()
        return h


class RpcCollector(Collector):
    def __init__(self, stats: RpcStats) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        handled = CounterMetricFamily(
            "burstgate_grpc_server_handled",
            "RPCs completed, by service, method and gRPC status code",
            labels=["service", "method", "code"],
        )
        for (service, method, code), n in sorted(self._stats.handled.copy().items()):
            handled.add_metric([service, method, code], n)
        yield handled
        latency = HistogramMetricFamily(
            "burstgate_decision_duration_seconds",
            "Server-side time to decide: Admit per call, AdmitStream per batch",
            labels=["method"],
        )
        for method, hist in sorted(self._stats.decision_latency.copy().items()):
            buckets, total = hist.buckets()
            latency.add_metric([method], buckets, total)
        yield latency
        failures = CounterMetricFamily(
            "burstgate_auth_failures",
            "Calls refused by authentication or authorization",
            labels=["reason"],
        )
        for reason, n in sorted(self._stats.auth_failures.copy().items()):
            failures.add_metric([reason], n)
        yield failures


class ReloadSource(Protocol):
    config_reloads: int
    config_reload_failures: int
    key_refresh_failures: int


class ServerCollector(Collector):
    """Config reloads of the running plane."""

    def __init__(self, plane: ReloadSource) -> None:
        self._plane = plane

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "burstgate_config_reloads",
            "Config (tenants, lanes, policy) applied from the database",
            value=self._plane.config_reloads,
        )
        yield CounterMetricFamily(
            "burstgate_config_reload_failures",
            "Config polls or reloads that failed (the last config keeps serving)",
            value=self._plane.config_reload_failures,
        )
        yield CounterMetricFamily(
            "burstgate_key_refresh_failures",
            "Key-cache refreshes that failed (the keys last read keep serving)",
            value=self._plane.key_refresh_failures,
        )


# Factories called with the ControlPlane at start; each returns a collector.
# Packages that need the plane (ledger writer lag, queues ...) append here.
EXTRA_COLLECTORS: list[Callable[[Any], Collector]] = []

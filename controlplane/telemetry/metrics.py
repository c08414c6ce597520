"""Prometheus metrics read from the service at scrape time.

The admission path only bumps plain ints in the service
(``service.stats``); this collector turns them into metric families when
Prometheus scrapes, so a decision pays no metrics-library cost.

Other modules contribute collectors: anything with ``collect()`` yielding
metric families (``prometheus_client.registry.Collector``) is passed to
``registry_for(service, *extra)``; ``ControlPlane.metrics_collectors`` is the
list the server registers at start, so a package appends its collector there.
Collectors run on the HTTP server's thread: read plain values that the
event loop publishes, never call into the fast path from ``collect()``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector, CollectorRegistry

from controlplane.service import AdmissionService
from controlplane.service.stats import QUEUE_WAIT_BUCKETS_NS
from controlplane.settings import Settings
from controlplane.telemetry.grpc_metrics import RpcCollector, RpcStats
from controlplane.telemetry.histogram import LATENCY_BUCKETS_S, LatencyHistogram
from controlplane.telemetry.tenant_metrics import TenantLabels, tenant_families

# Re-exported: their home moved (histogram.py, grpc_metrics.py); importers
# of this module keep working.
__all__ = [
    "LATENCY_BUCKETS_S",
    "AdmissionCollector",
    "LatencyHistogram",
    "RpcCollector",
    "RpcStats",
    "ServerCollector",
    "TenantLabels",
    "registry_for",
]


class AdmissionCollector(Collector):
    """The service's counters and state. ``labels``: which tenants get a
    ``tenant`` label value of their own (tenant_metrics.py); shared with the
    live sampler's per-tenant gauges so both name the same tenants."""

    def __init__(self, service: AdmissionService, labels: TenantLabels | None = None) -> None:
        self._svc = service
        # without the live sampler's labels: the settings' default limit
        limit = Settings.model_fields["metrics_tenant_label_limit"].default
        self._labels = labels if labels is not None else TenantLabels(limit)

    def collect(self) -> Iterator[Metric]:
        info = InfoMetricFamily("burstgate_fastpath", "Which fast-path implementation is live")
        info.add_metric([], {"implementation": self._svc.implementation})
        yield info
        yield from tenant_families(self._svc, self._labels)
        yield GaugeMetricFamily(
            "burstgate_open_reservations",
            "Admitted requests not yet settled",
            value=self._svc.views.open_reservations,
        )
        # Memory protection's caps (settings, fixed at start): alert on the
        # open count nearing the overall one before Admits are refused.
        limits = self._svc.limits
        caps = GaugeMetricFamily(
            "burstgate_open_reservations_limit",
            "Most open reservations held before Admit answers OPEN_RESERVATIONS "
            "(scope overall or per tenant; 0 = no cap)",
            labels=["scope"],
        )
        caps.add_metric(["overall"], limits.max_open_reservations)
        caps.add_metric(["tenant"], limits.max_open_reservations_per_tenant)
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
        for lane, n in sorted(svc.views.queue_depths().items()):
            depth.add_metric([lane], n)
        yield depth
        waits = HistogramMetricFamily(
            "burstgate_queue_wait_seconds",
            "Time Admit calls waited in a lane's queue (admitted or timed out)",
            labels=["lane"],
        )
        bounds = [ns / 1e9 for ns in QUEUE_WAIT_BUCKETS_NS]
        for lane, counts in sorted(svc.stats.queue_wait_buckets.copy().items()):
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
        yield CounterMetricFamily(
            "burstgate_offline_booked",
            "Requests a sidecar admitted while this server was unreachable (fail-open), "
            "booked by their Complete",
            value=svc.stats.offline_booked_total,
        )
        yield CounterMetricFamily(
            "burstgate_reservations_restored",
            "Open reservations sidecars re-announced to this replica after their pool's "
            "cell moved here (several replicas), restored and counted",
            value=svc.stats.restored_total,
        )
        target = GaugeMetricFamily(
            "burstgate_lane_wait_target_seconds",
            "The lane's configured queue-wait target (wait_target_ms), for comparing "
            "burstgate_queue_wait_seconds with",
            labels=["lane"],
        )
        for name, cfg in sorted(svc.views.lanes.items()):
            target.add_metric([name], cfg.wait_target_ms / 1000)
        yield target


def registry_for(
    service: AdmissionService, *extra: Collector, tenant_labels: TenantLabels | None = None
) -> CollectorRegistry:
    """A registry with the admission collector, prometheus_client's standard
    collectors (``process_*``: RSS, CPU, open fds; ``python_info``;
    ``python_gc_*``), which only its default registry has otherwise, and
    any ``extra`` collectors. ``tenant_labels``: the live sampler's, so the
    tenant label names the same tenants everywhere."""
    registry = CollectorRegistry()
    registry.register(AdmissionCollector(service, tenant_labels))
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    for collector in extra:
        registry.register(collector)
    return registry


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

"""Prometheus metrics read from the service at scrape time.

The admission path only bumps plain ints in the service
(``decision_counts``); this collector turns them into metric families when
Prometheus scrapes, so a decision pays no metrics-library cost.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from controlplane.domain import Decision
from controlplane.service import AdmissionService
from fastpath import Reason


class AdmissionCollector(Collector):
    def __init__(self, service: AdmissionService) -> None:
        self._svc = service

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily | InfoMetricFamily]:
        info = InfoMetricFamily("burstgate_fastpath", "Which fast-path implementation is live")
        info.add_metric([], {"implementation": self._svc.implementation})
        yield info
        decisions = CounterMetricFamily(
            "burstgate_decisions",
            "Admission decisions by outcome and reason",
            labels=["decision", "reason"],
        )
        for (decision, reason), n in sorted(self._svc.decision_counts.items()):
            decisions.add_metric([Decision(decision).name.lower(), Reason(reason).name.lower()], n)
        yield decisions
        yield GaugeMetricFamily(
            "burstgate_open_reservations",
            "Admitted requests not yet settled",
            value=self._svc.open_reservations,
        )
        yield CounterMetricFamily(
            "burstgate_reservations_expired",
            "Reservations released by the TTL without a Complete",
            value=self._svc.expired_total,
        )


def registry_for(service: AdmissionService) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(AdmissionCollector(service))
    return registry

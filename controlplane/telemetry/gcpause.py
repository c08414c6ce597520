"""Garbage-collector pauses as a Prometheus histogram.

A full collection stops the event loop, and with it every decision: the
pause is a latency every Admit in flight pays. CPython reports each
collection's start and stop to ``gc.callbacks``; this times them (two
``perf_counter`` calls and a bisect per collection, on whichever thread
collected) into plain-int histograms per generation, turned into a metric
family at scrape time (``burstgate_gc_pause_seconds``).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from controlplane.telemetry.metrics import LatencyHistogram


class GcPauses(Collector):
    """Times every collection once ``install()``ed. Besides the histograms,
    plain totals for benchmarks: ``total_s``, ``collections`` per generation
    and ``longest_s`` (a benchmark may reset it between its intervals)."""

    def __init__(self) -> None:
        self.histograms = [LatencyHistogram() for _ in range(3)]
        self.total_s = 0.0
        self.collections = [0, 0, 0]
        self.longest_s = 0.0
        self._started = 0.0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        pause = time.perf_counter() - self._started
        generation = min(int(info.get("generation", 2)), 2)
        self.histograms[generation].observe(pause)
        self.total_s += pause
        self.collections[generation] += 1
        if pause > self.longest_s:
            self.longest_s = pause

    def install(self) -> GcPauses:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)
        return self

    def uninstall(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(
            "burstgate_gc_pause_seconds",
            "Garbage-collector pauses (the event loop, and every decision, stops)",
            labels=["generation"],
        )
        for generation, histogram in enumerate(self.histograms):
            buckets, total = histogram.buckets()
            family.add_metric([str(generation)], buckets, total)
        yield family

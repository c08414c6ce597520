"""Prometheus metrics of metering, read at scrape time from plain counters
(the ``Collector`` mechanism of controlplane/telemetry/metrics.py)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from controlplane.ledger.fencing import WINDOWS_TABLE
from controlplane.ledger.metering import Metering
from controlplane.ledger.writer import BATCH_BUCKETS_S


class LedgerCollector(Collector):
    def __init__(self, metering: Metering) -> None:
        self._m = metering

    def collect(self) -> Iterator[Metric]:
        m = self._m
        w = m.writer
        st = w.stats
        yield GaugeMetricFamily(
            "burstgate_ledger_database_up",
            "1 while ledger records are committed to the database, 0 while they are spooled",
            value=1 if w.db_ok else 0,
        )
        records = CounterMetricFamily(
            "burstgate_ledger_records",
            "Ledger records made durable, by where: database (commit) or spool (fsync)",
            labels=["sink"],
        )
        records.add_metric(["database"], st.written)
        records.add_metric(["spool"], st.spooled)
        yield records
        yield CounterMetricFamily(
            "burstgate_ledger_replayed_records",
            "Spooled records replayed into the database",
            value=st.replayed,
        )
        yield GaugeMetricFamily(
            "burstgate_ledger_spool_bytes", "Bytes waiting in the spool", value=m.spool.bytes
        )
        yield GaugeMetricFamily(
            "burstgate_ledger_spool_limit_bytes",
            "Bound of the spool (Complete answers UNAVAILABLE past it)",
            value=m.spool.max_bytes,
        )
        yield GaugeMetricFamily(
            "burstgate_ledger_spool_records",
            "Records in the spool not yet in the database",
            value=len(w.pending),
        )
        yield GaugeMetricFamily(
            "burstgate_ledger_queue", "Records waiting for the next group commit", value=w.queued
        )
        yield CounterMetricFamily(
            "burstgate_ledger_rejected_spool_full",
            "Completes refused (UNAVAILABLE) because the database was down and the spool full",
            value=st.rejected_spool_full,
        )
        yield CounterMetricFamily(
            "burstgate_ledger_database_failures",
            "Ledger writes or probes that failed or timed out",
            value=st.db_failures,
        )
        # Its _count and _sum are the group commits and the time spent in
        # them (the counters burstgate_ledger_batches_total and
        # burstgate_ledger_batch_seconds_total were before this histogram).
        batches = HistogramMetricFamily(
            "burstgate_ledger_batch_duration_seconds",
            "Duration of each group commit of ledger records to the database "
            "(committed batches; a failed or timed-out one counts in database_failures)",
        )
        counts = list(st.batch_buckets)  # a copy: the event loop keeps counting
        cumulative, acc = [], 0
        for bound, n in zip((*BATCH_BUCKETS_S, None), counts, strict=True):
            acc += n
            cumulative.append(("+Inf" if bound is None else repr(bound), float(acc)))
        batches.add_metric([], cumulative, st.batch_seconds)
        yield batches
        yield CounterMetricFamily(
            "burstgate_ledger_duplicate_completes",
            "Completes answered from an existing record (duplicate=true)",
            value=m.duplicates,
        )
        yield CounterMetricFamily(
            "burstgate_ledger_unpriced_records",
            "Records priced at zero because the price catalog had no entry",
            value=m.unpriced,
        )
        yield CounterMetricFamily(
            "burstgate_margin_warnings",
            "Margin warnings recorded (tenant x window with actual cost > ratio x user charge)",
            value=m.margin_warnings_total,
        )
        yield GaugeMetricFamily(
            "burstgate_margin_warning_tenants",
            "Tenants with a margin warning in the last window checked",
            value=m.last_margin_tenants,
        )
        stale = CounterMetricFamily(
            "burstgate_ha_stale_writes",
            "Single-writer rows not written because this replica's lease of their cell was "
            "superseded (stale epoch) or gone: none of them landed",
            labels=["table"],
        )
        by_table = m.stale_writes.by_table
        for table in sorted({WINDOWS_TABLE, *by_table}):
            stale.add_metric([table], by_table[table])
        yield stale

"""Live state read from the serving process's memory: per-tenant bucket and
quota state, per-pool backpressure, and a sampler that publishes these for
Prometheus.

Everything that touches the service runs on the event-loop thread (the fast
path is not thread-safe): the admin servicer calls these directly, and the
metrics sampler runs as a task on the loop and publishes a plain snapshot
that the scrape thread only reads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from controlplane.clock import Sleep, real_sleep
from controlplane.service import AdmissionService
from controlplane.service.demand import PoolDemand
from controlplane.telemetry.tenant_metrics import OTHER, TenantLabels
from fastpath.codes import NS_PER_DAY, NS_PER_HOUR

MTOK_PER_TOKEN = 1000  # the fast path counts milli-tokens


@dataclass(frozen=True, slots=True)
class TenantLive:
    tenant_id: str
    bucket_tokens: int
    burst_tokens: int
    hourly_used: int
    daily_used: int
    hourly_quota: int  # -1 = unlimited
    daily_quota: int
    in_flight: int
    in_flight_tokens: int
    queued: int


@dataclass(frozen=True, slots=True)
class PoolLive:
    pool: str
    engines: int
    backpressure: float
    pricing_multiplier: float
    # The prefix-cache miss rate of its fresh reports (None: none measures
    # it), and the eviction advice its ReportLoad answers carry now.
    kv_cache_miss_rate: float | None = None
    evict_below_reuse_per_s: float = 0.0


def tenant_live(service: AdmissionService, tenant_id: str) -> TenantLive:
    """One tenant's state now; NotFound for an unknown tenant. Loop thread only."""
    snap = service.views.tenant_state(tenant_id)  # refilled to now
    now = service.clock()
    # Quota counters roll over lazily on the next decision: a counter from
    # an earlier hour/day is zero now.
    hour_used = snap["hour_used"] if snap["hour_idx"] == now // NS_PER_HOUR else 0
    day_used = snap["day_used"] if snap["day_idx"] == now // NS_PER_DAY else 0
    return TenantLive(
        tenant_id=tenant_id,
        bucket_tokens=snap["level_mtok"] // MTOK_PER_TOKEN,
        burst_tokens=snap["burst_mtok"] // MTOK_PER_TOKEN,
        hourly_used=hour_used,
        daily_used=day_used,
        hourly_quota=snap["hourly_quota"] or -1,
        daily_quota=snap["daily_quota"] or -1,
        in_flight=snap["inflight"],
        in_flight_tokens=snap["inflight_tokens"],
        queued=service.views.tenant_queued(tenant_id),
    )


def pools_live(service: AdmissionService) -> list[PoolLive]:
    """Every pool that reported: fresh engines, the service's own backpressure
    score (``pool_views()``), pricing multiplier, prefix-cache miss rate and
    eviction advice. Loop thread only."""
    now = service.clock()
    stale_ns = int(service.limits.load_report_stale_s * 1_000_000_000)
    scored = service.views.pool_views()
    reports = service.views.pools
    out = []
    for pool in sorted(set(reports) | set(scored)):
        engines = reports.get(pool, {}).values()
        fresh = sum(1 for s in engines if now - s.received_ns <= stale_ns)
        score = float(scored[pool][0]) if pool in scored else 0.0
        multiplier = service.pricing.quote(pool, "", now).multiplier
        _, evict_below = service.views.eviction_advice(pool)
        out.append(PoolLive(pool, fresh, score, multiplier,
                            service.views.pool_miss_rate(pool), evict_below))  # fmt: skip
    return out


def pools_demand(service: AdmissionService) -> list[PoolDemand]:
    """Demand, backlog and desired engines of every pool the service knows
    of (declared, reported, asked or holding work). Loop thread only."""
    now = service.clock()
    return [service.views.pool_demand(pool, now) for pool in service.views.demand_pools()]


@dataclass(frozen=True, slots=True)
class LiveSnapshot:
    in_flight_requests: int = 0
    in_flight_tokens: int = 0
    tenants: int = 0
    pools: tuple[PoolLive, ...] = ()
    # Every tenant; the collector decides which get a label of their own.
    per_tenant: tuple[TenantLive, ...] = ()
    # What each pool is asked and needs (AdmissionService.views.pool_demand)
    demand: tuple[PoolDemand, ...] = ()
    samples: int = field(default=0)


class LiveSampler:
    """Samples live state on the loop every ``interval_s`` and publishes a
    snapshot; ``collector`` turns the latest one into metric families."""

    def __init__(
        self,
        service: AdmissionService,
        *,
        interval_s: float,
        tenant_label_limit: int,
        sleep: Sleep = real_sleep,
    ) -> None:
        self.service = service
        self._sleep = sleep
        self.interval_s = interval_s
        self.tenant_label_limit = tenant_label_limit
        # Which tenants get a ``tenant`` label value of their own: shared with
        # the per-tenant counters (registry_for), so both name the same ones.
        self.tenant_labels = TenantLabels(tenant_label_limit)
        self.snapshot = LiveSnapshot()

    def sample(self) -> LiveSnapshot:
        """Loop thread only."""
        svc = self.service
        tenants = []
        for tenant_id in svc.views.tenant_ids():
            with contextlib.suppress(Exception):  # removed between the two calls
                tenants.append(tenant_live(svc, tenant_id))
        self.snapshot = LiveSnapshot(
            in_flight_requests=sum(t.in_flight for t in tenants),
            in_flight_tokens=sum(t.in_flight_tokens for t in tenants),
            tenants=len(tenants),
            pools=tuple(pools_live(svc)),
            per_tenant=tuple(tenants),
            demand=tuple(pools_demand(svc)),
            samples=self.snapshot.samples + 1,
        )
        return self.snapshot

    async def run(self) -> None:
        while True:
            self.sample()
            await self._sleep(self.interval_s)

    def collector(self) -> Collector:
        return _LiveCollector(self, self.tenant_labels)


class _LiveCollector(Collector):
    def __init__(self, sampler: LiveSampler, labels: TenantLabels) -> None:
        self._sampler = sampler
        self._labels = labels

    def collect(self) -> Iterator[Metric]:
        snap = self._sampler.snapshot
        yield GaugeMetricFamily(
            "burstgate_inflight_requests",
            "Admitted requests not yet settled, all tenants",
            value=snap.in_flight_requests,
        )
        yield GaugeMetricFamily(
            "burstgate_inflight_tokens",
            "Tokens reserved by admitted requests not yet settled, all tenants",
            value=snap.in_flight_tokens,
        )
        yield GaugeMetricFamily("burstgate_tenants", "Configured tenants", value=snap.tenants)
        engines = GaugeMetricFamily(
            "burstgate_pool_engines_reporting",
            "Engines of the pool with a fresh load report",
            labels=["pool"],
        )
        score = GaugeMetricFamily(
            "burstgate_pool_backpressure_score",
            "Backpressure score B of the pool (0..1; hard reject above bp_hard_threshold)",
            labels=["pool"],
        )
        price = GaugeMetricFamily(
            "burstgate_pool_pricing_multiplier",
            "Pricing multiplier in force for the pool",
            labels=["pool"],
        )
        miss = GaugeMetricFamily(
            "burstgate_pool_kv_cache_miss_rate",
            "Prefix-cache miss rate of the pool's fresh load reports (0..1, weighted by batch "
            "capacity; absent while no engine measures it)",
            labels=["pool"],
        )
        evict = GaugeMetricFamily(
            "burstgate_pool_evict_below_reuse_per_second",
            "KV-cache eviction advice answered to the pool's load reports: evict cached "
            "blocks reused less often than this per second (lower when the pool is busier)",
            labels=["pool"],
        )
        for p in snap.pools:
            engines.add_metric([p.pool], p.engines)
            score.add_metric([p.pool], p.backpressure)
            price.add_metric([p.pool], p.pricing_multiplier)
            if p.kv_cache_miss_rate is not None:
                miss.add_metric([p.pool], p.kv_cache_miss_rate)
            evict.add_metric([p.pool], p.evict_below_reuse_per_s)
        yield from (engines, score, price, miss, evict)
        yield from _demand(snap.demand)
        yield from self._tenants(snap.per_tenant)

    def _tenants(self, tenants: tuple[TenantLive, ...]) -> Iterator[Metric]:
        """Tenants with a label of their own get their own series (all of
        them while the configured tenants fit in the limit); the rest are
        summed under ``__other__`` where a sum means something (in-flight and
        hourly tokens; a sum of bucket levels would not)."""
        labels = self._labels
        labels.assign_all(t.tenant_id for t in tenants)
        bucket = GaugeMetricFamily(
            "burstgate_tenant_bucket_tokens", "Token bucket level", labels=["tenant"]
        )
        inflight = GaugeMetricFamily(
            "burstgate_tenant_inflight_tokens", "Reserved, unsettled tokens", labels=["tenant"]
        )
        hourly = GaugeMetricFamily(
            "burstgate_tenant_hourly_used_tokens", "Tokens used this UTC hour", labels=["tenant"]
        )
        other_inflight = other_hourly = 0
        others = False
        for t in tenants:
            if labels.label(t.tenant_id, assign=False) == OTHER:
                others = True
                other_inflight += t.in_flight_tokens
                other_hourly += t.hourly_used
                continue
            bucket.add_metric([t.tenant_id], t.bucket_tokens)
            inflight.add_metric([t.tenant_id], t.in_flight_tokens)
            hourly.add_metric([t.tenant_id], t.hourly_used)
        if others:
            inflight.add_metric([OTHER], other_inflight)
            hourly.add_metric([OTHER], other_hourly)
        yield bucket
        yield inflight
        yield hourly


def _demand(pools: tuple[PoolDemand, ...]) -> Iterator[Metric]:
    """The autoscaling signals (docs/autoscaling.md, "Signals")."""
    tokens = GaugeMetricFamily(
        "burstgate_pool_demand_tokens_per_second",
        "Prompt tokens asked of the pool per second over the last 10 s: admitted, held "
        "and refused for capacity (not for a tenant's own limits)",
        labels=["pool"],
    )
    requests = GaugeMetricFamily(
        "burstgate_pool_demand_requests_per_second",
        "Requests asked of the pool per second over the last 10 s: admitted, held and "
        "refused for capacity (not for a tenant's own limits)",
        labels=["pool"],
    )
    desired = GaugeMetricFamily(
        "burstgate_pool_desired_engines",
        "Engines the pool needs to take its demand at the target utilisation and release "
        "its backlog within every lane's SLO, from the per-engine work rate the gate learns",
        labels=["pool"],
    )
    predicted = GaugeMetricFamily(
        "burstgate_pool_desired_engines_predicted",
        "Engines the pool will need an engine start-up from now, from the burst forecaster's "
        "demand forecast",
        labels=["pool"],
    )
    backlog = GaugeMetricFamily(
        "burstgate_pool_backlog_requests",
        "Requests held in burstgate's queues for the pool",
        labels=["pool", "lane"],
    )
    backlog_tokens = GaugeMetricFamily(
        "burstgate_pool_backlog_tokens",
        "Prompt tokens of the requests held in burstgate's queues for the pool",
        labels=["pool", "lane"],
    )
    wait = GaugeMetricFamily(
        "burstgate_pool_predicted_wait_seconds",
        "How long a new request of the lane would wait for the pool before release "
        "(absent while work is held and the pool's pace is not known yet)",
        labels=["pool", "lane"],
    )
    for d in pools:
        tokens.add_metric([d.pool], d.demand_tokens_per_s)
        requests.add_metric([d.pool], d.demand_requests_per_s)
        desired.add_metric([d.pool], d.desired_engines)
        predicted.add_metric([d.pool], d.desired_engines_predicted)
        for b in d.lanes:
            backlog.add_metric([d.pool, b.lane], b.requests)
            backlog_tokens.add_metric([d.pool, b.lane], b.tokens)
            if b.predicted_wait_s is not None:
                wait.add_metric([d.pool, b.lane], b.predicted_wait_s)
    yield from (tokens, requests, desired, predicted, backlog, backlog_tokens, wait)

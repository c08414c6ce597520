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
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from controlplane.clock import Sleep, real_sleep
from controlplane.domain import LoadSample
from controlplane.domain.policy import Policy
from controlplane.service import AdmissionService
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


def tenant_live(service: AdmissionService, tenant_id: str) -> TenantLive:
    """One tenant's state now; NotFound for an unknown tenant. Loop thread only."""
    snap = service.tenant_state(tenant_id)  # refilled to now
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
        queued=service.tenant_queued(tenant_id),
    )


def _engine_reports(service: AdmissionService) -> dict[str, list[LoadSample]]:
    """pool -> latest report per engine. ``service.pools`` maps a pool to its
    engines (a dict, or an object with ``.engines`` in older services)."""
    out: dict[str, list[LoadSample]] = {}
    pools: Mapping[str, Any] = service.pools
    for name, pool in pools.items():
        engines = pool if isinstance(pool, Mapping) else pool.engines
        out[name] = list(engines.values())
    return out


def spec_score(fresh: Sequence[LoadSample], policy: Policy) -> float:
    """SPEC section 2's B over a pool's fresh reports (sums, so a big engine
    weighs more); 0 when none reports."""
    if not fresh:
        return 0.0
    batch = sum(s.batch_tokens for s in fresh) / sum(s.max_batch_tokens for s in fresh)
    queue = sum(s.queue_depth for s in fresh) / sum(s.queue_capacity for s in fresh)
    miss = sum(s.kv_cache_miss_rate for s in fresh) / len(fresh)
    return policy.bp_alpha * batch + policy.bp_beta * queue + policy.bp_gamma * miss


def pools_live(service: AdmissionService) -> list[PoolLive]:
    """Every pool that reported: fresh engines, backpressure, pricing multiplier.
    The backpressure score is the service's own (``pool_views()``) when it
    scores pools, else :func:`spec_score`. Loop thread only."""
    now = service.clock()
    stale_ns = int(service.settings.load_report_stale_s * 1_000_000_000)
    views = getattr(service, "pool_views", None)
    scored: Mapping[str, tuple[float, int, bool]] = views() if callable(views) else {}
    reports = _engine_reports(service)
    out = []
    for pool in sorted(set(reports) | set(scored)):
        fresh = [s for s in reports.get(pool, ()) if now - s.received_ns <= stale_ns]
        score = float(scored[pool][0]) if pool in scored else spec_score(fresh, service.policy)
        multiplier = service.pricing.quote(pool, "", now).multiplier
        out.append(PoolLive(pool, len(fresh), score, multiplier))
    return out


@dataclass(frozen=True, slots=True)
class LiveSnapshot:
    in_flight_requests: int = 0
    in_flight_tokens: int = 0
    tenants: int = 0
    pools: tuple[PoolLive, ...] = ()
    # Per-tenant series only while the tenant count is within the configured bound.
    per_tenant: tuple[TenantLive, ...] = ()
    tenant_series_dropped: bool = False
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
        self.snapshot = LiveSnapshot()

    def sample(self) -> LiveSnapshot:
        """Loop thread only."""
        svc = self.service
        tenants = []
        for tenant_id in svc.tenant_ids():
            with contextlib.suppress(Exception):  # removed between the two calls
                tenants.append(tenant_live(svc, tenant_id))
        within = len(tenants) <= self.tenant_label_limit
        self.snapshot = LiveSnapshot(
            in_flight_requests=sum(t.in_flight for t in tenants),
            in_flight_tokens=sum(t.in_flight_tokens for t in tenants),
            tenants=len(tenants),
            pools=tuple(pools_live(svc)),
            per_tenant=tuple(tenants) if within else (),
            tenant_series_dropped=not within,
            samples=self.snapshot.samples + 1,
        )
        return self.snapshot

    async def run(self) -> None:
        while True:
            self.sample()
            await self._sleep(self.interval_s)

    def collector(self) -> Collector:
        return _LiveCollector(self)


class _LiveCollector(Collector):
    def __init__(self, sampler: LiveSampler) -> None:
        self._sampler = sampler

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
        for p in snap.pools:
            engines.add_metric([p.pool], p.engines)
            score.add_metric([p.pool], p.backpressure)
            price.add_metric([p.pool], p.pricing_multiplier)
        yield engines
        yield score
        yield price
        if snap.per_tenant:
            bucket = GaugeMetricFamily(
                "burstgate_tenant_bucket_tokens", "Token bucket level", labels=["tenant"]
            )
            inflight = GaugeMetricFamily(
                "burstgate_tenant_inflight_tokens", "Reserved, unsettled tokens", labels=["tenant"]
            )
            hourly = GaugeMetricFamily(
                "burstgate_tenant_hourly_used_tokens",
                "Tokens used this UTC hour",
                labels=["tenant"],
            )
            for t in snap.per_tenant:
                bucket.add_metric([t.tenant_id], t.bucket_tokens)
                inflight.add_metric([t.tenant_id], t.in_flight_tokens)
                hourly.add_metric([t.tenant_id], t.hourly_used)
            yield bucket
            yield inflight
            yield hourly

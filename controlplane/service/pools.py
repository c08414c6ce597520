"""Engine pools: load reports turned into backpressure and degradation.

Each engine's latest report is kept; on every report the pool's aggregate is
recomputed (sums over the engines whose reports are fresh) and scored by the
fast path's ``backpressure_score_ppm``. Decisions read the cached aggregate,
so scoring costs nothing per request. Everything is integer ppm (1.0 =
1,000,000) like the fast path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from controlplane.domain import LoadSample
from controlplane.domain.policy import Policy
from controlplane.domain.units import NS_PER_S, PPM
from fastpath import backpressure_score_ppm

# The fast path's bound on batch tokens (keeps its ppm products in int64).
MAX_BATCH = 10**12

# Freshness of a pool's view (same numbers as burstgate.v1.PoolFreshness).
FRESH = 1
STALE = 2
UNKNOWN = 3


def ppm(x: float) -> int:
    return round(x * PPM)


@dataclass(slots=True)
class PoolView:
    """What admission needs to know about one pool, recomputed per report."""

    score_ppm: int = 0
    # Score points lost per second (EWMA over reports); <= 0 = not draining.
    drain_ppm_per_s: int = 0
    degraded: bool = False
    last_report_ns: int = 0
    engines_fresh: int = 0


@dataclass(slots=True)
class Pool:
    engines: dict[str, LoadSample] = field(default_factory=dict)
    view: PoolView = field(default_factory=PoolView)

    def fresh(self, now_ns: int, stale_ns: int) -> list[LoadSample]:
        return [s for s in self.engines.values() if now_ns - s.received_ns <= stale_ns]


# Weight of the newest drain-rate sample in the EWMA: half, so one noisy
# report cannot swing the retry_after hint on its own.
DRAIN_EWMA_NEW = 0.5


class PoolBook:
    def __init__(self, stale_ns: int) -> None:
        self.pools: dict[str, Pool] = {}
        self.stale_ns = stale_ns

    def report(self, sample: LoadSample, policy: Policy) -> int:
        """Store a report and rescore the pool; returns its fresh engine count."""
        pool = self.pools.get(sample.pool)
        if pool is None:
            pool = self.pools[sample.pool] = Pool()
        pool.engines[sample.engine_id] = sample
        self.rescore(pool, sample.received_ns, policy)
        return pool.view.engines_fresh

    def rescore(self, pool: Pool, now_ns: int, policy: Policy) -> None:
        fresh = pool.fresh(now_ns, self.stale_ns)
        view = pool.view
        old_score, old_ns = view.score_ppm, view.last_report_ns
        if fresh:
            batch = sum(s.batch_tokens for s in fresh)
            max_batch = sum(s.max_batch_tokens for s in fresh)
            depth = sum(s.queue_depth for s in fresh)
            capacity = sum(s.queue_capacity for s in fresh)
            # KV-cache miss rate weighted by each engine's batch capacity.
            miss = sum(s.kv_cache_miss_rate * s.max_batch_tokens for s in fresh) / max_batch
            gpu = sum(s.gpu_utilization for s in fresh) / len(fresh)
            alpha, beta = ppm(policy.bp_alpha), ppm(policy.bp_beta)
            # gamma as the remainder so the weights sum to exactly 1e6 ppm
            view.score_ppm = backpressure_score_ppm(
                min(batch, MAX_BATCH), min(max_batch, MAX_BATCH), depth, capacity, ppm(miss),
                alpha, beta, PPM - alpha - beta,
            )  # fmt: skip
            view.degraded = depth > policy.degrade_queue_depth or gpu > policy.degrade_gpu_util
        else:
            view.score_ppm = 0
            view.degraded = False
        if old_ns and now_ns > old_ns:
            rate = (old_score - view.score_ppm) * NS_PER_S // (now_ns - old_ns)
            view.drain_ppm_per_s = int(
                DRAIN_EWMA_NEW * rate + (1 - DRAIN_EWMA_NEW) * view.drain_ppm_per_s
            )
        view.last_report_ns = now_ns
        view.engines_fresh = len(fresh)

    def rescore_all(self, now_ns: int, policy: Policy) -> None:
        """After a policy change (weights, triggers) every pool is rescored."""
        for pool in self.pools.values():
            if pool.engines:
                self.rescore(pool, max(s.received_ns for s in pool.engines.values()), policy)

    def view(self, name: str, now_ns: int) -> tuple[PoolView | None, int]:
        """The pool's view and its freshness (FRESH, STALE or UNKNOWN)."""
        pool = self.pools.get(name)
        if pool is None or not pool.engines:
            return None, UNKNOWN
        if now_ns - pool.view.last_report_ns > self.stale_ns:
            return pool.view, STALE
        return pool.view, FRESH

"""Engine pools: load reports turned into backpressure and degradation.

Each engine's latest report is kept; on every report the pool's aggregate is
recomputed (sums over the engines whose reports are fresh) and scored by the
fast path's ``backpressure_score_ppm``, renormalised over the signals
present. Decisions read the cached aggregate, so scoring costs nothing per
request. Everything is integer ppm (1.0 =
1,000,000) like the fast path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from controlplane.domain import LoadSample
from controlplane.domain.policy import Policy
from controlplane.domain.units import NS_PER_S, PPM
from fastpath import backpressure_score_ppm
from fastpath.codes import MAX_BACKPRESSURE_CAPACITY

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


def pool_miss_rate(fresh: list[LoadSample]) -> float | None:
    """The pool's prefix-cache miss rate: the engines' reported rates weighted
    by batch capacity over those that measure it; None when none does."""
    measured = [s for s in fresh if s.kv_cache_miss_rate is not None]
    if not measured:
        return None
    weight = sum(s.max_batch_tokens for s in measured)
    return sum((s.kv_cache_miss_rate or 0.0) * s.max_batch_tokens for s in measured) / weight


def pool_score_ppm(fresh: list[LoadSample], policy: Policy) -> int:
    """The backpressure score of a pool's fresh reports: the weighted mean of
    the signals present (docs/burst-shaping.md, "The backpressure score"). Sums over the
    engines, so a big engine weighs more; an engine without a bounded queue
    (``queue_capacity`` 0, vLLM) counts the gate's per-engine target as its
    capacity; the prefix-cache miss rate is weighted by batch capacity over
    the engines that measure it, KV usage averaged over those that report it,
    and a signal no engine reports leaves the mean."""
    cap = MAX_BACKPRESSURE_CAPACITY
    batch = min(sum(s.batch_tokens for s in fresh), cap)
    max_batch = min(sum(s.max_batch_tokens for s in fresh), cap)
    depth = min(sum(s.queue_depth for s in fresh), cap)
    capacity = min(sum(s.queue_capacity or policy.gate_waiting_per_engine for s in fresh), cap)
    rate = pool_miss_rate(fresh)
    miss = -1 if rate is None else ppm(rate)
    usage = [s.kv_cache_usage for s in fresh if s.kv_cache_usage is not None]
    kv = ppm(sum(usage) / len(usage)) if usage else -1
    return backpressure_score_ppm(
        batch, max_batch, depth, capacity, miss, kv,
        ppm(policy.bp_alpha), ppm(policy.bp_beta), ppm(policy.bp_gamma), ppm(policy.bp_delta),
    )  # fmt: skip


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
            view.score_ppm = pool_score_ppm(fresh, policy)
            depth = sum(s.queue_depth for s in fresh)
            gpu = sum(s.gpu_utilization for s in fresh) / len(fresh)
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

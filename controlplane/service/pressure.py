"""Backpressure: engine load reports turned into a verdict per (lane, pool).

The pool book (``pools.py``) keeps each engine's latest report and the pool's
scored aggregate; this part validates reports at the edge, holds the shed
thresholds derived from the policy (one per lane, by priority), and answers,
for a request of a lane on a pool, whether the pool's load lets it through,
sheds it (it may wait for the pool to drain) or refuses it outright, and
whether degradation caps its output.
"""

from __future__ import annotations

from typing import NamedTuple

from controlplane.domain import LaneConfig, LoadSample
from controlplane.domain.errors import InvalidArgument
from controlplane.domain.policy import Policy
from controlplane.domain.units import NS_PER_S, PPM
from controlplane.domain.validate import check_fraction, check_id
from controlplane.service.pools import FRESH, UNKNOWN, PoolBook, ppm
from fastpath import Reason, backpressure_retry_ns, shed_threshold_ppm
from fastpath.codes import MAX_BACKPRESSURE_CAPACITY

_OK = int(Reason.OK)


class Verdict(NamedTuple):
    """What the pool's load means for one request of a lane."""

    reason: int  # OK or BACKPRESSURE
    retry_ns: int  # when refused: from the pool's drain rate, capped
    score_ppm: int  # the pool's backpressure score (or the stale policy's)
    freshness: int  # pools.FRESH / STALE / UNKNOWN
    shed: bool  # refused but may wait (between the lane's shed and the hard threshold)
    degraded_cap: int  # max_tokens cap under degradation, 0 = none


class PressureGate:
    def __init__(self, stale_ns: int) -> None:
        self.book = PoolBook(stale_ns=stale_ns)
        self._policy: Policy | None = None
        self._shed_ppm: dict[str, int] = {}
        self._hard_ppm = PPM
        self._cap_ns = 0
        self._fail_open: set[str] = set()
        self._degradable: set[str] = set()

    def configure(self, lanes_by_priority: list[LaneConfig], policy: Policy, now: int) -> None:
        """Derive the lanes' shed thresholds from the policy: fail-open lanes
        are never shed; the others are shed lowest priority first, spread
        between the soft and the hard threshold."""
        self._policy = policy
        soft, hard = ppm(policy.bp_soft_threshold), ppm(policy.bp_hard_threshold)
        sheddable = [lane for lane in reversed(lanes_by_priority) if not lane.fail_open]
        self._shed_ppm = {lane.name: PPM + 1 for lane in lanes_by_priority}  # never
        for rank, lane in enumerate(sheddable):
            self._shed_ppm[lane.name] = shed_threshold_ppm(rank, len(sheddable), soft, hard)
        self._hard_ppm = hard
        self._cap_ns = int(policy.bp_retry_cap_s * NS_PER_S)
        self._fail_open = {lane.name for lane in lanes_by_priority if lane.fail_open}
        self._degradable = {lane.name for lane in lanes_by_priority if lane.degradable}
        self.book.rescore_all(now, policy)

    def verdict(self, lane: str, pool: str, now: int) -> Verdict:
        """Backpressure and degradation for a request of ``lane`` on ``pool``."""
        policy = self._policy
        assert policy is not None, "configure() first"
        view, freshness = self.book.view(pool, now) if pool else (None, UNKNOWN)
        if freshness == FRESH:
            assert view is not None
            score = view.score_ppm
            cap = policy.degrade_max_tokens if view.degraded and lane in self._degradable else 0
        else:
            # Stale or unknown: the configured policy decides, and says so.
            score = PPM if policy.stale_policy == "fail_closed" else 0
            cap = 0
        # an unknown tenant's fallback lane may not be configured: never shed
        # (its request is refused for the tenant before this matters)
        shed_at = self._shed_ppm.get(lane, PPM + 1)
        if lane in self._fail_open or score < shed_at:
            return Verdict(_OK, 0, score, freshness, False, cap)
        drain = view.drain_ppm_per_s if view is not None and freshness == FRESH else 0
        retry = backpressure_retry_ns(score, shed_at, drain, self._cap_ns)
        # Between the lane's shed threshold and the hard one the request may
        # wait for the pool to drain; above the hard threshold it is refused,
        # unless the pool gate is on: then it waits too, and is refused only
        # when it can no longer be released in time for its SLO.
        shed = score < self._hard_ppm or policy.pool_gate
        return Verdict(Reason.BACKPRESSURE, retry, score, freshness, shed, cap)

    def report(self, sample: LoadSample) -> int:
        """Store a validated report and rescore its pool; returns the pool's
        fresh engine count."""
        assert self._policy is not None, "configure() first"
        return self.book.report(sample, self._policy)

    def score(self, pool: str, now: int) -> float:
        """The pool's backpressure score (0 for a pool that never reported)."""
        view, _ = self.book.view(pool, now)
        return 0.0 if view is None else view.score_ppm / PPM

    def views(self, now: int) -> dict[str, tuple[float, int, bool]]:
        """pool -> (backpressure score, freshness, degraded), for operators."""
        out: dict[str, tuple[float, int, bool]] = {}
        for name in self.book.pools:
            view, freshness = self.book.view(name, now)
            if view is not None:
                out[name] = (view.score_ppm / PPM, freshness, view.degraded)
        return out

    def reports(self) -> dict[str, dict[str, LoadSample]]:
        """pool -> engine id -> latest load report."""
        return {name: dict(p.engines) for name, p in self.book.pools.items()}


def load_sample(
    pool: str,
    engine_id: str,
    batch_tokens: int,
    max_batch_tokens: int,
    queue_depth: int,
    queue_capacity: int,
    kv_cache_miss_rate: float | None,
    gpu_utilization: float,
    now: int,
    requests_running: int | None = None,
    max_num_seqs: int | None = None,
    kv_cache_usage: float | None = None,
) -> LoadSample:
    """A load report checked at the edge with the fast path's real bounds
    (InvalidArgument names the field; nothing is stored before this passes)."""
    check_id("pool", pool)
    check_id("engine_id", engine_id)
    _check_count("batch_tokens", batch_tokens, 0)
    _check_count("max_batch_tokens", max_batch_tokens, 1)
    _check_count("queue_depth", queue_depth, 0)
    _check_count("queue_capacity", queue_capacity, 0)
    if kv_cache_miss_rate is not None:
        check_fraction("kv_cache_miss_rate", kv_cache_miss_rate)
    check_fraction("gpu_utilization", gpu_utilization)
    if requests_running is not None:
        _check_count("requests_running", requests_running, 0)
    if max_num_seqs is not None:
        _check_count("max_num_seqs", max_num_seqs, 1)
    if kv_cache_usage is not None:
        check_fraction("kv_cache_usage", kv_cache_usage)
    return LoadSample(
        pool, engine_id, batch_tokens, max_batch_tokens, queue_depth, queue_capacity,
        kv_cache_miss_rate, gpu_utilization, now, requests_running, max_num_seqs, kv_cache_usage,
    )  # fmt: skip


def _check_count(field: str, value: int, low: int) -> None:
    # The fast path scores sums of these in int64 ppm: a count above
    # MAX_BACKPRESSURE_CAPACITY is not a real engine's and is refused here.
    if not (low <= value <= MAX_BACKPRESSURE_CAPACITY):
        raise InvalidArgument(
            field, f"must be between {low} and {MAX_BACKPRESSURE_CAPACITY}, got {value}"
        )


# Adaptive KV-cache eviction advice by load (SPEC section 2): (load above,
# evict blocks reused less than this many times per second), first match.
EVICTION_STEPS: tuple[tuple[float, float], ...] = ((0.85, 0.05), (0.50, 0.15))
EVICTION_DEFAULT = 0.30


def eviction_advice(load: float) -> float:
    """Reuse rate (per second) under which an engine should evict cached
    blocks, given its pool's load: the busier, the more it keeps."""
    for above, rate in EVICTION_STEPS:
        if load > above:
            return rate
    return EVICTION_DEFAULT

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
        shed_at = self._shed_ppm[lane]
        if lane in self._fail_open or score < shed_at:
            return Verdict(_OK, 0, score, freshness, False, cap)
        drain = view.drain_ppm_per_s if view is not None and freshness == FRESH else 0
        retry = backpressure_retry_ns(score, shed_at, drain, self._cap_ns)
        # Between the lane's shed threshold and the hard one the request may
        # wait for the pool to drain; above the hard threshold it is refused.
        return Verdict(Reason.BACKPRESSURE, retry, score, freshness, score < self._hard_ppm, cap)

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
    kv_cache_miss_rate: float,
    gpu_utilization: float,
    now: int,
) -> LoadSample:
    """A load report checked at the edge (InvalidArgument names the field)."""
    check_id("pool", pool)
    check_id("engine_id", engine_id)
    if batch_tokens < 0:
        raise InvalidArgument("batch_tokens", f"must be >= 0, got {batch_tokens}")
    if max_batch_tokens <= 0:
        raise InvalidArgument("max_batch_tokens", f"must be > 0, got {max_batch_tokens}")
    if queue_depth < 0:
        raise InvalidArgument("queue_depth", f"must be >= 0, got {queue_depth}")
    if queue_capacity <= 0:
        raise InvalidArgument("queue_capacity", f"must be > 0, got {queue_capacity}")
    check_fraction("kv_cache_miss_rate", kv_cache_miss_rate)
    check_fraction("gpu_utilization", gpu_utilization)
    return LoadSample(
        pool, engine_id, batch_tokens, max_batch_tokens, queue_depth, queue_capacity,
        kv_cache_miss_rate, gpu_utilization, now,
    )  # fmt: skip


def check_load_extras(
    requests_running: int | None, max_num_seqs: int | None, kv_cache_usage: float | None
) -> None:
    """The optional vLLM fields of a load report, checked at the edge."""
    if requests_running is not None and requests_running < 0:
        raise InvalidArgument("requests_running", f"must be >= 0, got {requests_running}")
    if max_num_seqs is not None and max_num_seqs <= 0:
        raise InvalidArgument("max_num_seqs", f"must be > 0, got {max_num_seqs}")
    if kv_cache_usage is not None:
        check_fraction("kv_cache_usage", kv_cache_usage)


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

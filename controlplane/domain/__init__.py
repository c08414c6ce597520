"""Plain data the service layer speaks: tenant and lane configuration,
decisions and settlements. No protobuf, no ORM."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from decimal import Decimal

from fastpath import Reason

# Identifier limits at the edge: long enough for UUIDs and prefixed ids, short
# enough that a hostile caller cannot make us keep megabytes per request.
MAX_ID_LEN = 128
MAX_MODEL_LEN = 256
# The fast path's own bound (fastpath.codes.MAX_REQUEST_TOKENS): anything
# larger is a client bug, not a real LLM request.
MAX_TOKENS_PER_FIELD = 10_000_000


class Decision(enum.IntEnum):
    # Same numbering as burstgate.v1.Decision.
    ADMIT = 1
    REJECT = 2


@dataclass(frozen=True, slots=True)
class LaneConfig:
    """A lane. ``pool``: the engine pool of its requests when neither the
    request nor its tenant names one (``TenantDirectory.pool_for``); None =
    not configured."""

    name: str
    priority: int
    weight: Decimal
    wait_target_ms: int
    fail_open: bool
    degradable: bool
    max_queued: int | None = None  # None = the policy's lane_queue_limit
    pool: str | None = None  # None = not configured


# The SPEC's default lanes (section 1), as the first migration seeds them and
# controlplane/demo.yaml lists them: for harnesses that run without a database.
DEFAULT_LANES = (
    LaneConfig("premium", 0, Decimal("0.40"), 200, True, False),
    LaneConfig("standard", 1, Decimal("0.45"), 800, False, True),
    LaneConfig("batch", 2, Decimal("0.15"), 5000, False, True),
)


@dataclass(frozen=True, slots=True)
class TenantConfig:
    """A tenant's limits; ``None`` means unlimited.

    ``pool`` is the engine pool of the tenant's requests that name none
    (before the lane's pool and "default"; ``TenantDirectory.pool_for``);
    None = not configured."""

    tenant_id: str
    token_rate: Decimal  # tokens per second
    burst_tokens: int
    enabled: bool = True
    hourly_quota: int | None = None
    daily_quota: int | None = None
    max_concurrency: int | None = None
    max_queued: int | None = None
    max_tokens_per_request: int | None = None
    default_lane: str = "standard"
    shadow_mode: bool = False
    dedicated_quota: int | None = None
    fallback_model: str | None = None
    display_name: str = ""
    max_wait_ms: int | None = None  # None = the lane's wait target
    long_request_tokens: int | None = None  # None = the policy's threshold
    demote_long_requests: bool = True
    pool: str | None = None  # None = not configured

    @property
    def rate_mtok_per_s(self) -> int:
        # The fast path counts milli-tokens; token_rate has 3 decimals.
        return int(self.token_rate * 1000)


@dataclass(frozen=True, slots=True)
class Degradation:
    """Instructions for a request admitted while its pool is degraded."""

    max_tokens_cap: int
    page_after_tokens: int
    fallback_model: str


@dataclass(frozen=True, slots=True)
class Pressure:
    """The request's pool as the decision saw it."""

    score: float  # backpressure score B in [0, 1]
    freshness: int  # 1 fresh, 2 stale, 3 unknown (burstgate.v1.PoolFreshness)
    stale_policy: str  # how a stale/unknown pool was treated; "" when fresh
    shed: bool  # the lane was held back by backpressure


@dataclass(frozen=True, slots=True)
class AdmitDecision:
    request_id: str
    decision: Decision
    reason: Reason
    retry_after_ns: int
    reserved_tokens: int
    reservation_id: int
    granted_max_tokens: int
    bucket_remaining: int
    hourly_remaining: int
    daily_remaining: int
    lane: str
    message: str = ""
    duplicate: bool = False
    pricing_multiplier: float = 1.0
    queue_wait_ns: int = 0
    degradation: Degradation | None = None
    shadow_reason: int = 0  # Reason the request would have been refused for (shadow mode)
    pressure: Pressure | None = None
    retryable: bool = False  # a refusal that retrying (after retry_after) may cure
    # Admitted: the plane's signature over the admission (service/signing.py)
    admission_token: bytes = b""


@dataclass(frozen=True, slots=True)
class Settlement:
    request_id: str
    reserved_tokens: int
    actual_tokens: int
    refunded_tokens: int
    duplicate: bool = False


@dataclass(frozen=True, slots=True)
class LoadSample:
    pool: str
    engine_id: str
    batch_tokens: int
    max_batch_tokens: int
    queue_depth: int  # requests waiting (vLLM: num_requests_waiting)
    queue_capacity: int  # 0 = unbounded (vLLM): pressure measured against the gate's target
    kv_cache_miss_rate: float | None  # prefix-cache miss rate; None = not measured
    gpu_utilization: float
    received_ns: int
    # vLLM's own signals, when the engine reports them
    requests_running: int | None = None  # num_requests_running
    max_num_seqs: int | None = None  # the engine's max_num_seqs
    kv_cache_usage: float | None = None  # kv_cache_usage_perc, as a fraction

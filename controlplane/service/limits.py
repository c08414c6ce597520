"""A tenant's limits and where it stands now (the GetLimits RPC), for the
rate-limit headers a sidecar puts on its HTTP answers (x-ratelimit-*).

Read from the fast path's slot after a refill to now, so the figures agree
with what the next Admit would see; nothing changes."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

from controlplane.domain.units import NS_PER_DAY, NS_PER_HOUR, NS_PER_MS, NS_PER_S

MTOK = 1000  # the fast path counts milli-tokens
UNLIMITED = -1


@dataclass(frozen=True, slots=True)
class TenantLimits:
    tenant_id: str
    token_rate: Decimal  # tokens per second
    burst_tokens: int
    bucket_tokens: int  # < 0: in debt
    bucket_full_in_ms: int
    hourly_quota: int  # -1 = unlimited, as the *_remaining and max_concurrency
    hourly_remaining: int
    daily_quota: int
    daily_remaining: int
    max_concurrency: int
    inflight_requests: int
    hour_resets_in_ms: int
    day_resets_in_ms: int


def _ceil_ms(ns: int) -> int:
    return -(-ns // NS_PER_MS)


def _quota(quota: int, idx: int, used: int, now_idx: int) -> tuple[int, int]:
    """(quota, remaining), -1 for both when unlimited (0 in the fast path);
    usage counted in an earlier hour/day no longer counts."""
    if quota == 0:
        return UNLIMITED, UNLIMITED
    return quota, max(0, quota - (used if idx == now_idx else 0))


def describe(tenant_id: str, state: dict[str, int], now: int) -> TenantLimits:
    """``state``: the slot's snapshot refilled to ``now`` (TenantDirectory.state)."""
    rate = state["rate_mtok_per_s"]
    burst, level = state["burst_mtok"], state["level_mtok"]
    full_in_ns = 0 if level >= burst else -(-(burst - level) * NS_PER_S // rate)
    hq, hrem = _quota(state["hourly_quota"], state["hour_idx"], state["hour_used"],
                      now // NS_PER_HOUR)  # fmt: skip
    dq, drem = _quota(state["daily_quota"], state["day_idx"], state["day_used"],
                      now // NS_PER_DAY)  # fmt: skip
    conc = state["max_concurrency"]
    return TenantLimits(
        tenant_id=tenant_id,
        token_rate=Decimal(rate) / MTOK,
        burst_tokens=burst // MTOK,
        bucket_tokens=level // MTOK if level >= 0 else -(-level // MTOK),
        bucket_full_in_ms=_ceil_ms(full_in_ns),
        hourly_quota=hq,
        hourly_remaining=hrem,
        daily_quota=dq,
        daily_remaining=drem,
        max_concurrency=conc if conc > 0 else UNLIMITED,
        inflight_requests=state["inflight"],
        hour_resets_in_ms=_ceil_ms(NS_PER_HOUR - now % NS_PER_HOUR),
        day_resets_in_ms=_ceil_ms(NS_PER_DAY - now % NS_PER_DAY),
    )

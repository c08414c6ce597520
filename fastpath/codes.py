"""Decision reasons and the fixed-point units and limits shared by both fastpath builds.

Every number the bucket and scheduling arithmetic depends on lives here.  The compiled
modules (`_buckets_c.pyx`, `_sched_c.pyx`) repeat them as C constants because C
arithmetic needs them at compile time; a unit test asserts the copies agree.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Final

__all__ = [
    "MAX_BACKPRESSURE_CAPACITY",
    "MAX_BURST_MTOK",
    "MAX_FLOWS",
    "MAX_GLOBAL_INFLIGHT_TOKENS",
    "MAX_NOW_NS",
    "MAX_RATE_MTOK_PER_S",
    "MAX_REQUEST_TOKENS",
    "MAX_SLOTS",
    "MAX_USAGE_TOKENS",
    "MTOK_PER_TOKEN",
    "NS_PER_DAY",
    "NS_PER_HOUR",
    "NS_PER_S",
    "PPM",
    "RETRY_AFTER_NS_MAX",
    "VT_MAX",
    "Reason",
]


class Reason(IntEnum):
    """Why an admission was refused (``OK`` when it was not).

    0-5, 8 and 12 are produced by the fastpath; 6, 7, 9-11 and 13 are reserved for the
    service and rpc layers and defined here only so that the numbering lives in one place.
    """

    OK = 0
    TOKEN_RATE = 1  # the token bucket holds less than the request's cost
    HOURLY_QUOTA = 2  # the current UTC hour's token quota would be exceeded
    DAILY_QUOTA = 3  # the current UTC day's token quota would be exceeded
    CONCURRENCY = 4  # the tenant already has max_concurrency requests in flight
    MAX_TOKENS = 5  # the request can never be admitted (too large for some limit)
    UNKNOWN_TENANT = 6  # service layer only: no such tenant
    TENANT_DISABLED = 7  # service layer only: tenant exists but is switched off
    GLOBAL_WATERMARK = 8  # all tenants' in-flight tokens would pass the global safe level
    BACKPRESSURE = 9  # service layer only: the pool's backpressure score sheds this lane
    QUEUE_TIMEOUT = 10  # service layer only: queued, but the max wait passed first
    QUEUE_FULL = 11  # service layer only: the lane, tenant or global queue is full
    # Memory protection: the table holds its cap of open (unsettled) reservations, over
    # all slots or for this slot (``set_open_limits``); shadow mode is refused too.
    OPEN_RESERVATIONS = 12
    # Several replicas (docs/ha.md): another replica owns the entry's pool's cell.
    NOT_OWNER = 13  # rpc layer only: an AdmitStream entry sent to a replica that is not the owner


# Time is integer nanoseconds (the caller's clock, e.g. time.time_ns()).
NS_PER_S: Final = 1_000_000_000
NS_PER_HOUR: Final = 3_600 * NS_PER_S
NS_PER_DAY: Final = 86_400 * NS_PER_S  # quota days are UTC days: epoch-aligned, no leap seconds

# Bucket levels are integer milli-tokens, so fractional refill never needs floats.
MTOK_PER_TOKEN: Final = 1_000

# Limits.  Each keeps every int64 product and sum in the bucket arithmetic in range,
# so the C build never overflows and agrees bit for bit with Python's big ints.
MAX_RATE_MTOK_PER_S: Final = 1_000_000_000  # 1e6 tokens/s; rate * (ns < 1e9) stays < 1e18
MAX_BURST_MTOK: Final = 10**15  # 1e12 tokens; levels stay in [-1e15, 1e15], deficits < 2e15
MAX_REQUEST_TOKENS: Final = 10_000_000  # cap on prompt+estimate; cost * 1000 <= 1e10, sums tiny
MAX_NOW_NS: Final = 2**62  # year 2116; now + a day (next-window start) stays below 2**63
MAX_SLOTS: Final = 1 << 20  # slots are tenant indexes; caps the C slot array at 128 MiB
RETRY_AFTER_NS_MAX: Final = 2**63 - 1  # a wait beyond int64 ns (292 years) saturates: "never"
# Cap on the global in-flight watermark, in tokens.  Not an int64 need (the check is
# written as cost > limit - total, which cannot overflow for 0 <= total, limit < 2**63):
# 1e15 tokens is 1e8 maximal requests in flight at once, far beyond what any fleet's KV
# caches hold, so a larger value is a unit mistake rather than a setting.
MAX_GLOBAL_INFLIGHT_TOKENS: Final = 10**15
# Cap on quota usage restored at start (add_usage): the same bound, for the same reason;
# hour/day counters stay far below 2**63 however often it is called in one window.
MAX_USAGE_TOKENS: Final = 10**15

# Scheduling (fastpath/_sched_*): ratios are integer parts per million.
PPM: Final = 1_000_000  # 1.0
# Bound on max_batch_tokens and queue_capacity: min(x, cap) * PPM stays <= 1e18 < 2**63.
MAX_BACKPRESSURE_CAPACITY: Final = 10**12
# Flows of a FairQueue (lanes, or the tenant slots of one lane), like MAX_SLOTS: caps the
# C flow arrays at 40 MiB, and (hard - soft) * rank in shed_threshold_ppm at ~1e12.
MAX_FLOWS: Final = 1 << 20
# Largest virtual time a FairQueue keeps (and its largest renormalize_above).  One charge
# adds at most 2 * MAX_REQUEST_TOKENS * PPM // 1 = 2e13 < 2**45, so vt + charge < 2**62.
VT_MAX: Final = 2**61

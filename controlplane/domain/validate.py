"""Validation of domain values, one validator per domain object.

- the admission edge (``check_id``, ``check_tokens``, ...), shared by the
  unary and batched paths: each failure names the field (and the index
  inside a batch) so a sidecar author can fix it;
- ``check_tenant`` and ``check_lane``: the one validator of a tenant's and a
  lane's configuration, used by every entry point (YAML config, CLI, admin
  API) through the config repository. Bounds include the schema's own (32-bit
  columns, text lengths), so a value the database would refuse is an
  ``InvalidArgument`` naming the field, never an internal error.
"""

from __future__ import annotations

from collections.abc import Iterable
from decimal import Decimal

from controlplane.domain import (
    MAX_ID_LEN,
    MAX_MODEL_LEN,
    MAX_TOKENS_PER_FIELD,
    LaneConfig,
    TenantConfig,
)
from controlplane.domain.errors import InvalidArgument, excerpt
from controlplane.domain.units import NS_PER_DAY, NS_PER_HOUR

# The fast path's bounds (fastpath/codes.py), in tokens.
MAX_RATE_TOKENS_PER_S = Decimal(1_000_000)
MAX_BURST_TOKENS = 10**12
# Columns that are 32-bit INTEGER in the schema (the rest of the limits are BIGINT).
INT32_FIELDS = ("max_concurrency", "max_queued", "max_wait_ms")
INT32_MAX = 2**31 - 1
# BIGINT columns: a larger value would be refused by the database.
INT64_MAX = 2**63 - 1
MAX_TEXT = 256  # display_name, fallback_model
MAX_LANE_NAME = 32
MAX_POOL_LEN = 128  # engine pool names (AdmitRequest.pool, LoadReport.pool)
# Tenant limits where None means unlimited and a value must be > 0.
POSITIVE_LIMITS = (
    "hourly_quota",
    "daily_quota",
    "max_concurrency",
    "max_queued",
    "max_tokens_per_request",
    "dedicated_quota",
    "long_request_tokens",
)


def check_id(field: str, value: str, *, max_len: int = MAX_ID_LEN) -> None:
    if not value:
        raise InvalidArgument(field, "must not be empty")
    if len(value) > max_len:
        raise InvalidArgument(field, f"longer than {max_len} characters ({len(value)})")
    if not value.isprintable():
        raise InvalidArgument(field, "must not contain control characters")


def check_optional_name(field: str, value: str, *, max_len: int = MAX_MODEL_LEN) -> None:
    if len(value) > max_len:
        raise InvalidArgument(field, f"longer than {max_len} characters ({len(value)})")
    if value and not value.isprintable():
        raise InvalidArgument(field, "must not contain control characters")


def check_pool(pool: str | None) -> None:
    """A configured engine pool (tenant or lane): None (not configured), or
    a name as a load report gives it, so a configured pool can be reported."""
    if pool is not None:
        check_id("pool", pool)


def check_tokens(field: str, value: int) -> None:
    if value < 0:
        raise InvalidArgument(field, f"must be >= 0, got {value}")
    if value > MAX_TOKENS_PER_FIELD:
        raise InvalidArgument(field, f"must be <= {MAX_TOKENS_PER_FIELD:,}, got {value}")


def check_fraction(field: str, value: float) -> None:
    # NaN fails both comparisons, so test the positive range.
    if not (0.0 <= value <= 1.0):
        raise InvalidArgument(field, f"must be between 0 and 1, got {value}")


# Complete's sidecar timestamps (exec_start_unix_ns, exec_end_unix_ns; 0 =
# unset) are refused outside [now - reservation TTL - EXEC_TIME_PAST_SLACK_NS,
# now + EXEC_TIME_FUTURE_NS] on the server's clock: a request is settled at
# most a TTL after its admission, and the slack absorbs clock skew between
# the engine's host and the server. Anything else (1969, 2262) is a bug or a
# lie, and would be billed and exported as it is.
EXEC_TIME_PAST_SLACK_NS = NS_PER_DAY
EXEC_TIME_FUTURE_NS = NS_PER_HOUR


def check_exec_times(
    start_ns: int, end_ns: int, now_ns: int, ttl_ns: int, *, first_ns: int = 0
) -> None:
    """Complete's exec timestamps (and its first token's): in order, and each
    unset (0) or within the window above; raise InvalidArgument naming the
    wire field."""
    if start_ns and end_ns and end_ns < start_ns:
        raise InvalidArgument("exec_end_unix_ns", "is before exec_start_unix_ns")
    if first_ns and start_ns and first_ns < start_ns:
        raise InvalidArgument("first_token_unix_ns", "is before exec_start_unix_ns")
    if first_ns and end_ns and first_ns > end_ns:
        raise InvalidArgument("first_token_unix_ns", "is after exec_end_unix_ns")
    low = now_ns - ttl_ns - EXEC_TIME_PAST_SLACK_NS
    high = now_ns + EXEC_TIME_FUTURE_NS
    for field, value in (
        ("exec_start_unix_ns", start_ns),
        ("exec_end_unix_ns", end_ns),
        ("first_token_unix_ns", first_ns),
    ):
        if value and not low <= value <= high:
            raise InvalidArgument(
                field,
                f"{value} is outside [{low}, {high}]: from the reservation TTL plus one day "
                "before the server's clock to one hour after it (0 = unset)",
            )


def check_tenant(cfg: TenantConfig, lane_names: Iterable[str]) -> None:
    """A tenant's configuration; raise InvalidArgument naming the field."""
    check_id("tenant_id", cfg.tenant_id)
    if not (Decimal("0.001") <= cfg.token_rate <= MAX_RATE_TOKENS_PER_S):
        raise InvalidArgument(
            "token_rate", f"must be between 0.001 and {MAX_RATE_TOKENS_PER_S} tokens/s"
        )
    if cfg.token_rate != cfg.token_rate.quantize(Decimal("0.001")):
        raise InvalidArgument("token_rate", "at most 3 decimal places (milli-tokens)")
    if not (1 <= cfg.burst_tokens <= MAX_BURST_TOKENS):
        raise InvalidArgument("burst_tokens", f"must be between 1 and {MAX_BURST_TOKENS}")
    for name in POSITIVE_LIMITS:
        value = getattr(cfg, name)
        if value is not None and value <= 0:
            raise InvalidArgument(name, f"must be > 0 or unset (unlimited), got {value}")
    if cfg.max_wait_ms is not None and cfg.max_wait_ms < 0:
        raise InvalidArgument("max_wait_ms", f"must be >= 0 or unset, got {cfg.max_wait_ms}")
    for name in POSITIVE_LIMITS:
        value = getattr(cfg, name)
        bound = INT32_MAX if name in INT32_FIELDS else INT64_MAX
        if value is not None and value > bound:
            raise InvalidArgument(name, f"must be <= {bound}, got {value}")
    if cfg.max_wait_ms is not None and cfg.max_wait_ms > INT32_MAX:
        raise InvalidArgument("max_wait_ms", f"must be <= {INT32_MAX}, got {cfg.max_wait_ms}")
    for name in ("display_name", "fallback_model"):
        text = getattr(cfg, name) or ""
        if len(text) > MAX_TEXT:
            raise InvalidArgument(name, f"longer than {MAX_TEXT} characters")
        if text and not text.isprintable():
            raise InvalidArgument(name, "must not contain control characters")
    check_pool(cfg.pool)
    names = set(lane_names)
    if cfg.default_lane not in names:
        raise InvalidArgument(
            "default_lane",
            f"unknown lane {excerpt(cfg.default_lane)}; configured: {', '.join(sorted(names))}",
        )


def check_lane(lane: LaneConfig) -> None:
    """A lane's configuration; raise InvalidArgument naming the field."""
    check_id("name", lane.name, max_len=MAX_LANE_NAME)
    if lane.priority < 0 or lane.priority > INT32_MAX:
        raise InvalidArgument("priority", f"must be between 0 and {INT32_MAX}")
    if not (Decimal(0) < lane.weight <= 1):
        raise InvalidArgument("weight", f"must be in (0, 1], got {lane.weight}")
    if lane.weight != lane.weight.quantize(Decimal("0.0001")):
        raise InvalidArgument("weight", "at most 4 decimal places")
    if not 0 <= lane.wait_target_ms <= INT32_MAX:
        raise InvalidArgument("wait_target_ms", f"must be between 0 and {INT32_MAX}")
    if lane.max_queued is not None and not 0 <= lane.max_queued <= INT32_MAX:
        raise InvalidArgument("max_queued", f"must be between 0 and {INT32_MAX}, or unset")
    check_pool(lane.pool)

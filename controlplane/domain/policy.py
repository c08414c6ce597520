"""The burst-shaping policy: backpressure, degradation, queue bounds, shadow
mode and the global watermark (SPEC sections 1-2).

Defaults live here (they are the spec's defaults); ``BURSTGATE_POLICY__<KEY>``
environment variables override them at start, and operators override them
live through the ``policy_overrides`` table (admin API / CLI). The effective
policy is validated as a whole, so a bad combination (weights that do not sum
to 1, a soft threshold above the hard one) is refused naming the field.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, Self, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from controlplane.domain.errors import InvalidArgument, excerpt
from controlplane.domain.validate import INT32_MAX, INT64_MAX
from fastpath.codes import (
    MAX_BACKPRESSURE_CAPACITY,
    MAX_GLOBAL_INFLIGHT_TOKENS,
    MAX_REQUEST_TOKENS,
)


class Policy(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # B = (alpha*batch_tokens/max_batch_tokens + beta*queue_depth/queue_capacity
    #   + gamma*kv_cache_miss_rate + delta*kv_cache_usage) / (the weights of the
    # signals the reports carry). With a miss rate and no KV usage that is SPEC
    # section 2's formula (alpha + beta + gamma = 1); an engine without a
    # bounded queue (vLLM) has its queue measured against the gate's target
    # (gate_waiting_per_engine). docs/burst-shaping.md, "The backpressure score".
    bp_alpha: float = Field(default=0.4, ge=0, le=1)
    bp_beta: float = Field(default=0.3, ge=0, le=1)
    bp_gamma: float = Field(default=0.3, ge=0, le=1)
    # KV-cache usage, the signal that says most about an engine's room: weighted
    # as much as the batch.
    bp_delta: float = Field(default=0.4, ge=0, le=1)
    # Between soft and hard the lowest lanes are held in their queues, lowest
    # first; above hard, non-premium lanes are refused with BACKPRESSURE.
    bp_soft_threshold: float = Field(default=0.70, ge=0, le=1)
    bp_hard_threshold: float = Field(default=0.85, ge=0, le=1)
    # Cap on the retry_after of a BACKPRESSURE refusal (seconds).
    bp_retry_cap_s: float = Field(default=30.0, gt=0, le=3600)
    # A pool whose load reports are stale (or that never reported): fail_open
    # ignores backpressure, fail_closed treats the pool as fully loaded.
    stale_policy: Literal["fail_open", "fail_closed"] = "fail_open"

    # Graceful degradation triggers (per pool) and the instructions given.
    degrade_queue_depth: int = Field(default=5000, ge=0, le=MAX_BACKPRESSURE_CAPACITY)
    degrade_gpu_util: float = Field(default=0.92, ge=0, le=1)
    degrade_max_tokens: int = Field(default=32000, ge=1, le=MAX_REQUEST_TOKENS)
    degrade_page_tokens: int = Field(default=1024, ge=1, le=MAX_REQUEST_TOKENS)

    # Sum of all tenants' in-flight (reserved) tokens never passes this; 0 = off.
    global_inflight_tokens: int = Field(default=0, ge=0, le=MAX_GLOBAL_INFLIGHT_TOKENS)
    # A request over its tenant's burst (up to twice it) always waits for a
    # full bucket and goes into debt, charged in full, instead of being refused
    # for good. With bucket_debt, a request within the burst is also admitted
    # while the bucket is non-negative, down to one burst of debt. Off by
    # default: exact buckets (the level covers the cost) admit exactly
    # burst / cost requests of a burst, and measured with the gate, debt made
    # premium worse at 0.7x (docs/simulate.md).
    bucket_debt: bool = False
    # Shadow mode for everyone: decide and count, but admit.
    shadow_mode: bool = False

    # Queue bounds: all lanes together, per lane (unless the lane sets its
    # own), per tenant (unless the tenant sets max_queued).
    queue_limit: int = Field(default=10_000, ge=0, le=INT32_MAX)
    lane_queue_limit: int = Field(default=5_000, ge=0, le=INT32_MAX)
    tenant_queue_limit: int = Field(default=1_000, ge=0, le=INT32_MAX)
    # Length-aware placement: prompt + max_tokens above this goes to the
    # lowest lane (tenants may override or opt out).
    long_request_tokens: int = Field(default=16_000, ge=1, le=INT64_MAX)

    # Pools declared beyond the tenants' and lanes' own (docs/operating.md,
    # "Declaring pools"). A pool is accepted at a door only when declared:
    # listed here, named as a configured tenant's or lane's `pool`, or
    # `default`. Any other name (a typo, a wrong case, a made-up name) is
    # refused INVALID_ARGUMENT naming `pool`, and creates no state.
    known_pools: list[str] = Field(default_factory=list)
    # The pool gate (controlplane/service/gate.py): hold requests in
    # burstgate, in lane and fairness order, while the engine pool is
    # saturated, instead of letting them into the engines' FIFO queues
    # (measured in docs/simulate.md). Off: burstgate as it was before the gate.
    pool_gate: bool = True
    # Saturated = the engines' waiting requests (reported, plus releases since
    # the reports) reach this many per reporting engine.
    gate_waiting_per_engine: int = Field(default=2, ge=1, le=MAX_BACKPRESSURE_CAPACITY)
    # Saturated too when an engine's KV cache usage reaches this fraction.
    gate_kv_usage_threshold: float = Field(default=0.9, gt=0, le=1)
    # Without fresh reports: at most this many released, uncompleted requests
    # per pool (never unlimited).
    gate_fallback_inflight: int = Field(default=64, ge=1, le=INT32_MAX)
    # TTFT SLO per lane (ms). With the gate on, a held request may wait up to
    # its lane's SLO (bounded by its tenant's max wait and its own deadline);
    # the lane's wait target stays the target for ordering and alerts.
    lane_ttft_slo_ms: dict[str, Annotated[int, Field(ge=0, le=INT32_MAX)]] = Field(
        default_factory=lambda: {"premium": 1000, "standard": 3000, "batch": 15000}
    )
    # The share of a lane's TTFT SLO kept for the engine after release: a held
    # request still waiting after (1 - this) x its SLO is refused instead of
    # released late (a late answer is worth nothing and takes the engine's
    # time from requests that can still make it).
    gate_release_headroom: float = Field(default=0.25, ge=0, lt=1)

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        total = self.bp_alpha + self.bp_beta + self.bp_gamma
        if abs(total - 1.0) > 1e-9:
            raise ValueError(f"bp_alpha + bp_beta + bp_gamma must be 1, got {total:g}")
        if self.bp_soft_threshold > self.bp_hard_threshold:
            raise ValueError("bp_soft_threshold must not exceed bp_hard_threshold")
        return self


POLICY_KEYS = frozenset(Policy.model_fields)
# The upper bounds above keep every value within what the fast path and the
# queues take (int64 arrays, the global watermark's own cap, 32-bit queue
# bounds like a lane's max_queued): a larger value would be stored, then
# fail every config apply.


def _json_kind(value: Any) -> str:
    """How an error message names a decoded JSON value it refuses."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, str):
        return f"the string {excerpt(value)}"
    if isinstance(value, int | float):
        return excerpt(value)
    return "a list" if isinstance(value, list) else "an object"


def _integer(value: Any) -> int | None:
    """A JSON integer: an int, or a number without a fraction (JSON has one
    number type: 5.0 is 5); never a bool or a string."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return None


def _number(value: Any) -> float | None:
    """A finite JSON number as a float; never a bool or a string."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)  # an int beyond a float's range: OverflowError
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def typed_value(key: str, value: Any, field: str) -> Any:
    """``value``, decoded from JSON, as policy key ``key`` takes it: strictly
    of the key's type (an integer key takes no bool, string or fraction; a
    number key no bool or string; a boolean key only true or false; an enum
    key one of its strings). Raise InvalidArgument naming ``field`` and the
    expected type. Ranges are the model's (``effective_policy``)."""
    annotation = Policy.model_fields[key].annotation
    origin = get_origin(annotation)
    if annotation is bool:
        if isinstance(value, bool):
            return value
        expected = "a boolean (true or false)"
    elif annotation is int:
        integer = _integer(value)
        if integer is not None:
            return integer
        expected = "an integer"
    elif annotation is float:
        number = _number(value)
        if number is not None:
            return number
        expected = "a finite number"
    elif origin is Literal:
        allowed = get_args(annotation)
        if isinstance(value, str) and value in allowed:
            return value
        expected = "one of " + ", ".join(f'"{a}"' for a in allowed)
    elif origin is list:
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
        expected = "a list of strings"
    elif origin is dict:
        if isinstance(value, dict):
            numbers = {k: _integer(v) for k, v in value.items()}
            if all(n is not None for n in numbers.values()):
                return numbers
        expected = "an object of integers"
    else:  # a new key of another type: add its rule above
        raise AssertionError(f"policy key {key}: no type rule for {annotation}")
    raise InvalidArgument(field, f"expected {expected}, got {_json_kind(value)}")


def effective_policy(base: Policy, overrides: dict[str, Any]) -> Policy:
    """``base`` with ``overrides`` applied and the whole re-validated."""
    unknown = set(overrides) - POLICY_KEYS
    if unknown:
        raise InvalidArgument(sorted(unknown)[0], "unknown policy key")
    try:
        return Policy.model_validate(base.model_dump() | overrides)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "policy"
        raise InvalidArgument(field, first["msg"]) from exc

"""Argument checks, before anything is sent.

The same rules as the server's edge checks (burstgate_client/edge.py, kept
equal to the server's by a test), raised as ``ValueError`` naming the argument.
They matter more here than for a unary client: an AdmitStream batch with one
bad entry ends the whole stream on the server, which would fail every other
caller's entry sharing it.
"""

from __future__ import annotations

import math

from burstgate_client.edge import (
    MAX_ID_LEN,
    MAX_LANE_NAME,
    MAX_MODEL_LEN,
    MAX_POOL_LEN,
    MAX_TOKENS_PER_FIELD,
    check_fraction,
    check_id,
    check_optional_name,
    check_tokens,
)
from burstgate_client.errors import InvalidArgument


def _value_error(exc: InvalidArgument) -> ValueError:
    return ValueError(str(exc))


def _int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: must be an int, got {type(value).__name__}")
    return value


def _str(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{name}: must be a str, got {type(value).__name__}")
    return value


def check_deadline(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name}: must be a number of seconds, got {type(value).__name__}")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name}: must be > 0 seconds and finite, got {value}")
    return float(value)


# As the server's AdmitRequest.attempt: a client retrying more is looping.
MAX_ATTEMPT = 1_000


def check_admit_args(
    tenant_id: str, request_id: str, prompt_tokens: int, max_tokens: int,
    lane: str, model: str, pool: str, retry_key: str = "", attempt: int = 0,
) -> None:  # fmt: skip
    # The common case in one expression, inlined (a helper call per argument
    # cost as much as the rest of it); the precise check (and its message)
    # only when something is off. The same rules as the precise check.
    if (
        type(prompt_tokens) is int and 0 <= prompt_tokens <= MAX_TOKENS_PER_FIELD
        and type(max_tokens) is int and 0 <= max_tokens <= MAX_TOKENS_PER_FIELD
        and type(tenant_id) is str and 0 < len(tenant_id) <= MAX_ID_LEN
        and tenant_id.isprintable()
        and type(request_id) is str and 0 < len(request_id) <= MAX_ID_LEN
        and request_id.isprintable()
        and attempt == 0 and type(lane) is str and type(model) is str and type(pool) is str
        and type(retry_key) is str
        and (not lane or (len(lane) <= MAX_LANE_NAME and lane.isprintable()))
        and (not model or (len(model) <= MAX_MODEL_LEN and model.isprintable()))
        and (not pool or (len(pool) <= MAX_POOL_LEN and pool.isprintable()))
        and not retry_key
    ):  # fmt: skip
        return
    try:
        check_id("tenant_id", _str("tenant_id", tenant_id))
        check_id("request_id", _str("request_id", request_id))
        check_tokens("prompt_tokens", _int("prompt_tokens", prompt_tokens))
        check_tokens("max_tokens", _int("max_tokens", max_tokens))
        check_optional_name("lane", _str("lane", lane), max_len=MAX_LANE_NAME)
        check_optional_name("model", _str("model", model))
        check_optional_name("pool", _str("pool", pool), max_len=MAX_POOL_LEN)
        check_optional_name("retry_key", _str("retry_key", retry_key), max_len=MAX_ID_LEN)
    except InvalidArgument as exc:
        raise _value_error(exc) from None
    if not 0 <= _int("attempt", attempt) <= MAX_ATTEMPT:
        raise ValueError(f"attempt: must be between 0 and {MAX_ATTEMPT}, got {attempt}")


def check_complete_args(
    tenant_id: str, request_id: str, prompt_tokens: int, generated_tokens: int,
    cached_prompt_tokens: int, exec_start_unix_ns: int, exec_end_unix_ns: int,
    kv_cache_miss_rate: float | None, first_token_unix_ns: int = 0, correlation_id: str = "",
) -> None:  # fmt: skip
    try:
        check_id("tenant_id", _str("tenant_id", tenant_id))
        check_id("request_id", _str("request_id", request_id))
        check_optional_name("correlation_id", _str("correlation_id", correlation_id),
                            max_len=MAX_ID_LEN)  # fmt: skip
        check_tokens("prompt_tokens", _int("prompt_tokens", prompt_tokens))
        check_tokens("generated_tokens", _int("generated_tokens", generated_tokens))
        check_tokens("cached_prompt_tokens", _int("cached_prompt_tokens", cached_prompt_tokens))
        if kv_cache_miss_rate is not None:
            check_fraction("kv_cache_miss_rate", kv_cache_miss_rate)
    except InvalidArgument as exc:
        raise _value_error(exc) from None
    if cached_prompt_tokens > prompt_tokens:
        raise ValueError(
            f"cached_prompt_tokens: {cached_prompt_tokens} exceeds prompt_tokens {prompt_tokens}"
        )
    for name, ns in (("exec_start_unix_ns", exec_start_unix_ns),
                     ("exec_end_unix_ns", exec_end_unix_ns),
                     ("first_token_unix_ns", first_token_unix_ns)):  # fmt: skip
        if _int(name, ns) < 0:
            raise ValueError(f"{name}: must be >= 0 (0 = unknown), got {ns}")
    if exec_start_unix_ns and exec_end_unix_ns and exec_end_unix_ns < exec_start_unix_ns:
        raise ValueError("exec_end_unix_ns: is before exec_start_unix_ns")
    first = first_token_unix_ns
    if first and exec_start_unix_ns and first < exec_start_unix_ns:
        raise ValueError("first_token_unix_ns: is before exec_start_unix_ns")
    if first and exec_end_unix_ns and first > exec_end_unix_ns:
        raise ValueError("first_token_unix_ns: is after exec_end_unix_ns")


def check_window(value: float) -> float:
    """``batch_window_s``: seconds >= 0 and < 1 (0 = never hold an Admit)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"batch_window_s: must be a number of seconds, got {type(value).__name__}")
    if not 0 <= value < 1:  # (NaN too)
        raise ValueError(f"batch_window_s: must be >= 0 and < 1 s (0 = never hold), got {value}")
    return float(value)


def check_tenant_id(tenant_id: str) -> None:
    try:
        check_id("tenant_id", _str("tenant_id", tenant_id))
    except InvalidArgument as exc:
        raise _value_error(exc) from None

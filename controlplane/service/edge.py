"""Edge checks of Admit and AdmitStream input, before anything is decided.

A failure raises ``InvalidArgument`` naming the field (``field[i]`` inside a
batch) and changes no state.
"""

from __future__ import annotations

from collections.abc import Sequence

from controlplane.domain import MAX_ID_LEN, MAX_TOKENS_PER_FIELD
from controlplane.domain.errors import InvalidArgument, excerpt
from controlplane.domain.validate import (
    MAX_LANE_NAME,
    MAX_POOL_LEN,
    check_id,
    check_optional_name,
    check_tokens,
)
from controlplane.service.records import Key
from controlplane.service.tenants import TenantDirectory

# A client that retries this often is looping: refused as bad input.
MAX_ATTEMPT = 1_000


def check_admit(
    tenant_id: str,
    request_id: str,
    prompt: int,
    max_tokens: int,
    model: str,
    pool: str,
    lane: str = "",
) -> None:
    check_id("tenant_id", tenant_id)
    check_id("request_id", request_id)
    if len(lane) > MAX_LANE_NAME:  # (whether it exists is the tenant directory's check)
        raise InvalidArgument("lane", f"longer than {MAX_LANE_NAME} characters ({len(lane)})")
    check_tokens("prompt_tokens", prompt)
    check_tokens("max_tokens", max_tokens)
    check_optional_name("model", model)
    check_optional_name("pool", pool, max_len=MAX_POOL_LEN)


def check_batch(
    tenants: TenantDirectory,
    max_batch: int,
    tenant_ids: Sequence[str],
    request_ids: Sequence[str],
    lanes: Sequence[str],
    prompt_tokens: Sequence[int],
    max_tokens: Sequence[int],
    model: str,
    pool: str,
) -> list[str]:
    """Check a whole batch; return one lane entry per request ("" = the
    tenant's default), or [] when the batch names none. The cheap
    whole-column checks run first; the precise per-entry check (and its
    message) runs only when something is off."""
    n = len(tenant_ids)
    if n > max_batch:
        raise InvalidArgument("tenant_id", f"batch of {n} exceeds max_batch {max_batch}")
    for name, col in (
        ("request_id", request_ids),
        ("prompt_tokens", prompt_tokens),
        ("max_tokens", max_tokens),
    ):
        if len(col) != n:
            raise InvalidArgument(name, f"has {len(col)} entries, tenant_id has {n}")
    if len(lanes) not in (0, 1, n):
        raise InvalidArgument("lane", f"must have 0, 1 or {n} entries, got {len(lanes)}")
    check_optional_name("model", model)
    check_optional_name("pool", pool, max_len=MAX_POOL_LEN)
    if n and (
        min(prompt_tokens) < 0
        or max(prompt_tokens) > MAX_TOKENS_PER_FIELD
        or min(max_tokens) < 0
        or max(max_tokens) > MAX_TOKENS_PER_FIELD
    ):
        for i in range(n):
            check_tokens(f"prompt_tokens[{i}]", prompt_tokens[i])
            check_tokens(f"max_tokens[{i}]", max_tokens[i])
    if n and (
        min(map(len, tenant_ids)) == 0
        or max(map(len, tenant_ids)) > MAX_ID_LEN
        or min(map(len, request_ids)) == 0
        or max(map(len, request_ids)) > MAX_ID_LEN
    ):
        for i in range(n):
            check_id(f"tenant_id[{i}]", tenant_ids[i])
            check_id(f"request_id[{i}]", request_ids[i])
    if len(lanes) == 1:
        tenants.check_lane("lane[0]", lanes[0])
        lane_of = [lanes[0]] * n
    elif not lanes:
        lane_of = []
    else:
        lane_of = list(lanes)
        known = tenants.lanes
        for i, lane in enumerate(lane_of):
            if lane and lane not in known:
                tenants.check_lane(f"lane[{i}]", lane)
    # (distinct request ids, the usual case, are distinct keys: one set of
    # strings, whose hashes are cached, instead of a set of tuples)
    if len(set(request_ids)) != n and len(set(zip(tenant_ids, request_ids, strict=True))) != n:
        # The fast path would decide a repeated id twice; refuse instead.
        seen: set[Key] = set()
        for i, k in enumerate(zip(tenant_ids, request_ids, strict=True)):
            if k in seen:
                raise InvalidArgument(
                    f"request_id[{i}]", f"{excerpt(k[1])} appears twice in the batch"
                )
            seen.add(k)
    return lane_of


MAX_WAIT_MS = 3_600_000  # AdmitBatch.max_wait_ms: an hour at most


def check_max_wait(max_wait_ms: Sequence[int], n: int) -> list[int]:
    """AdmitBatch.max_wait_ms: 0, 1 or ``n`` entries, each 0..MAX_WAIT_MS;
    returns one entry per request."""
    if len(max_wait_ms) not in (0, 1, n):
        raise InvalidArgument(
            "max_wait_ms", f"must have 0, 1 or {n} entries, got {len(max_wait_ms)}"
        )
    for i, ms in enumerate(max_wait_ms):
        if not 0 <= ms <= MAX_WAIT_MS:
            raise InvalidArgument(f"max_wait_ms[{i}]", f"must be in [0, {MAX_WAIT_MS}], got {ms}")
    if len(max_wait_ms) == n:
        return list(max_wait_ms)
    return [max_wait_ms[0] if max_wait_ms else 0] * n


def check_retry(retry_key: str, attempt: int, index: str = "") -> None:
    """AdmitRequest.retry_key (empty, or an id) and attempt
    (0..MAX_ATTEMPT); ``index`` names a batch entry ("[i]")."""
    if retry_key:
        check_id(f"retry_key{index}", retry_key)
    if not 0 <= attempt <= MAX_ATTEMPT:
        raise InvalidArgument(
            f"attempt{index}", f"must be between 0 and {MAX_ATTEMPT}, got {attempt}"
        )


def check_retries(
    retry_keys: Sequence[str], attempts: Sequence[int], n: int
) -> tuple[list[str], list[int]]:
    """AdmitBatch.retry_key (0 or ``n`` entries, each empty or an id) and
    attempt (0, 1 or ``n`` entries, each 0..MAX_ATTEMPT); returns one of
    each per request."""
    if len(retry_keys) not in (0, n):
        raise InvalidArgument("retry_key", f"must have 0 or {n} entries, got {len(retry_keys)}")
    if len(attempts) not in (0, 1, n):
        raise InvalidArgument("attempt", f"must have 0, 1 or {n} entries, got {len(attempts)}")
    for i, key in enumerate(retry_keys):
        check_retry(key, 0, f"[{i}]")
    for i, attempt in enumerate(attempts):
        check_retry("", attempt, f"[{i}]")
    keys = list(retry_keys) if retry_keys else [""] * n
    if len(attempts) == n:
        return keys, list(attempts)
    return keys, [attempts[0] if attempts else 0] * n

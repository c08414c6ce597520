"""From an Envoy ``RateLimitRequest`` to what burstgate is asked (:class:`Ask`).

Envoy sends one descriptor per matching rate-limit configuration, each a list
of (key, value) entries built by its actions. burstgate decides a request
once, so the entries of all descriptors are read together: the configured
keys (config.py ``descriptors``) give the tenant, lane, pool, model, request
id, phase and a retry's key and attempt, wherever they sit; a key given
twice with different values is an error. Descriptors with none of those keys
are not burstgate's (answered OK with no limit, as envoyproxy/ratelimit
answers a descriptor it has no rule for).

The cost (docs/envoy.md, "hits_addend"):

- a descriptor's own ``hits_addend`` (newer Envoy sets it per descriptor,
  from ``RateLimit.hits_addend``: a number or a substitution format), the
  first one set among the mapped descriptors; explicitly 0 = a check that
  spends nothing;
- else the request's ``hits_addend`` when > 0 (proto3: 0 = not set);
- else ``defaults.estimate_tokens`` (request path only).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from controlplane._proto.envoy.service.ratelimit.v3 import rls_pb2 as rls
from controlplane.domain.validate import MAX_POOL_LEN
from controlplane.integrations.envoy.config import EnvoyConfig
from controlplane.service.edge import MAX_ATTEMPT

MAX_ID_LEN = 128
MAX_NAME_LEN = 64
MAX_TOKENS = 1_000_000_000  # Envoy's own bound on a hits_addend
USAGE_VALUES = ("reported", "missing", "none")  # the usage entry (config.py Keys.usage)


class Phase(StrEnum):
    REQUEST = "request"
    RESPONSE = "response"


class BadInput(Exception):
    """A request burstgate cannot decide; ``field`` names the descriptor
    entry (or request field) at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True, slots=True)
class Ask:
    tenant: str
    lane: str
    pool: str
    model: str
    request_id: str  # "" = none: nothing to settle later
    phase: Phase
    tokens: int  # the cost (request path) or the real usage (response path)
    cost_given: bool  # False: tokens is the configured estimate
    prompt_tokens: int | None  # the usage split, when both entries are given
    completion_tokens: int | None
    mapped: tuple[bool, ...]  # per descriptor: carries a burstgate entry
    retry_key: str = ""  # "" = the request id (a retry under its own id)
    attempt: int = 0  # 0 = a first attempt
    # response path: the answer carried no usage (settled at the reservation)
    usage_missing: bool = False


def _clean(field: str, value: str, max_len: int) -> str:
    if not value or len(value) > max_len or not value.isprintable():
        shown = value[:40] + ("..." if len(value) > 40 else "")
        raise BadInput(field, f"expected 1..{max_len} printable characters, got {shown!r}")
    return value


def _count(field: str, value: str) -> int:
    if not value.isdigit() or int(value) > MAX_TOKENS:
        raise BadInput(field, f"expected a token count 0..{MAX_TOKENS:,}, got {value[:40]!r}")
    return int(value)


def parse(request: rls.RateLimitRequest, cfg: EnvoyConfig) -> Ask:
    """Raises :class:`BadInput` naming the entry at fault."""
    if request.domain != cfg.domain:
        raise BadInput("domain", f"{request.domain[:64]!r} is not {cfg.domain!r}")
    if not request.descriptors:
        raise BadInput("descriptors", "no descriptor")
    k = cfg.descriptors
    wanted = {k.tenant, k.lane, k.pool, k.model, k.request_id, k.phase, k.prompt_tokens,
              k.completion_tokens, k.retry_key, k.attempt, k.usage}  # fmt: skip
    found: dict[str, str] = {}
    mapped: list[bool] = []
    hits: int | None = None
    for d in request.descriptors:
        ours = False
        for e in d.entries:
            if e.key not in wanted:
                continue
            ours = True
            prior = found.setdefault(e.key, e.value)
            if prior != e.value:
                raise BadInput(e.key, f"two values {prior[:40]!r} and {e.value[:40]!r}")
        mapped.append(ours)
        if ours and hits is None and d.HasField("hits_addend"):
            hits = d.hits_addend.value
    if not any(mapped):
        raise BadInput("descriptors", f"no entry with a burstgate key ({k.tenant!r}, ...)")
    phase_value = found.get(k.phase, Phase.REQUEST.value)
    try:
        phase = Phase(phase_value)
    except ValueError:
        raise BadInput(
            k.phase, f"expected 'request' or 'response', got {phase_value[:40]!r}"
        ) from None
    tenant = found.get(k.tenant) or cfg.defaults.tenant
    if tenant is None:
        raise BadInput(k.tenant, "no such entry and no defaults.tenant")
    given = hits is not None or request.hits_addend > 0
    if hits is None:
        hits = request.hits_addend or (cfg.defaults.estimate_tokens if phase == "request" else 0)
    if hits > MAX_TOKENS:
        raise BadInput("hits_addend", f"{hits:,} is more than {MAX_TOKENS:,}")
    prompt = _count(k.prompt_tokens, found[k.prompt_tokens]) if k.prompt_tokens in found else None
    completion = (
        _count(k.completion_tokens, found[k.completion_tokens])
        if k.completion_tokens in found
        else None
    )
    if (prompt is None) != (completion is None):
        missing = k.completion_tokens if completion is None else k.prompt_tokens
        raise BadInput(missing, "the usage split needs both prompt and completion tokens")
    usage = found.get(k.usage, "reported")
    if usage not in USAGE_VALUES:
        raise BadInput(k.usage, f"expected one of {', '.join(USAGE_VALUES)}, got {usage[:40]!r}")
    attempt = found.get(k.attempt, "0")
    if not attempt.isdigit() or len(attempt) > 4 or int(attempt) > MAX_ATTEMPT:
        raise BadInput(k.attempt, f"expected a retry count 0..{MAX_ATTEMPT}, got {attempt[:40]!r}")
    return Ask(
        tenant=_clean(k.tenant, tenant, MAX_ID_LEN),
        lane=_clean(k.lane, found[k.lane], MAX_NAME_LEN) if k.lane in found else cfg.defaults.lane,
        pool=_clean(k.pool, found[k.pool], MAX_POOL_LEN) if k.pool in found else cfg.defaults.pool,
        model=_clean(k.model, found[k.model], MAX_ID_LEN) if k.model in found else "",
        request_id=_clean(k.request_id, found[k.request_id], MAX_ID_LEN)
        if k.request_id in found
        else "",
        phase=phase,
        tokens=hits,
        cost_given=given,
        prompt_tokens=prompt,
        completion_tokens=completion,
        mapped=tuple(mapped),
        retry_key=_clean(k.retry_key, found[k.retry_key], MAX_ID_LEN)
        if k.retry_key in found
        else "",
        attempt=int(attempt),
        usage_missing=usage == "missing",
    )

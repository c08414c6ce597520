"""Which headers cross the proxy, and the ones the sidecar adds."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from multidict import CIMultiDict

if TYPE_CHECKING:
    from burstgate_client.sidecar.admitter import AdmissionLike

# Hop-by-hop (RFC 9110 7.6.1) and what aiohttp sets itself for the new hop.
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
    "te", "trailer", "transfer-encoding", "upgrade", "host", "content-length",
})  # fmt: skip
# Hints and routing meant for the sidecar are still passed on (the fake
# engine reads x-burstgate-output-tokens); these never are.
REQUEST_ID = "x-request-id"
LEDGER_ID = "x-burstgate-request-id"
PRICING = "x-burstgate-pricing-multiplier"
QUEUE_WAIT = "x-burstgate-queue-wait-ms"
DEGRADED = "x-burstgate-degraded"
OFFLINE = "x-burstgate-offline"
# An admitted request's max_tokens (per choice) when the grant is below what
# it asked (a degradation's cap, the tenant's per-request maximum): the
# engine was sent this, so the answer may stop at it (finish_reason length).
GRANTED_MAX_TOKENS = "x-burstgate-granted-max-tokens"
# The KV-cache eviction advice of the control plane's latest answer to this
# sidecar's load report (LoadReportAck.evict_below_reuse_per_s), on admitted
# answers: whatever sits in front of the engine (a router, an operator's
# script) can read it where it reads the answer (docs/sidecar.md).
EVICT_BELOW = "x-burstgate-evict-below-reuse-per-s"
MAX_REQUEST_ID = 128


def admission_headers(a: AdmissionLike) -> dict[str, str]:
    """The x-burstgate-* headers of an admitted request (the sidecar's
    answers, and the LiteLLM callback's)."""
    h: dict[str, str] = {}
    if a.pricing_multiplier:
        h[PRICING] = a.pricing_multiplier
    if a.queue_wait_ms > 0:
        h[QUEUE_WAIT] = str(a.queue_wait_ms)
    if a.degraded:
        parts = [f"max_tokens={a.max_tokens_cap}"] if a.max_tokens_cap else []
        parts += [f"model={a.fallback_model}"] if a.fallback_model else []
        h[DEGRADED] = "; ".join(parts) or "true"
    if a.offline:
        h[OFFLINE] = "true"
    return h


class BadHeader(ValueError):
    """A header the sidecar derives an id or a name from, that cannot be
    one: 400, naming the header."""


def text_of(headers: Mapping[str, str], name: str, *, max_len: int = 0) -> str:
    """The value of header ``name`` ("" when absent), checked as text the
    sidecar may use as an id or a name and send on: printable characters
    only (no TAB or other control character, no byte that is not UTF-8
    text), at most ``max_len`` of them when given. CR, LF, NUL and the
    other control characters never get this far: aiohttp's parser answers
    400 to them itself (docs/sidecar.md, "Bad requests")."""
    value = headers.get(name, "")
    if value and not value.isprintable():
        raise BadHeader(f"header {name}: must be printable text (no control characters, "
                        "UTF-8)")  # fmt: skip
    if max_len and len(value) > max_len:
        raise BadHeader(f"header {name}: longer than {max_len} characters ({len(value)})")
    return value


def new_request_id() -> str:
    """The id burstgate keys a request on (request_id: its reservation and
    its ledger row): minted here for every request, never the client's, so
    that a client reusing its x-request-id cannot ride on an earlier
    request's admission or settlement."""
    return uuid.uuid4().hex


def correlation_id(headers: Mapping[str, str]) -> str:
    """The client's x-request-id ("" when none), kept as the request's
    correlation id (the ledger records it; not unique). Raises BadHeader."""
    return text_of(headers, REQUEST_ID, max_len=MAX_REQUEST_ID)


# Retries (docs/gate.md, "Retries"): the client's own key for a request, and
# how many times it has retried it (the official openai clients send it).
IDEMPOTENCY_KEY = "idempotency-key"
RETRY_COUNT = "x-stainless-retry-count"
MAX_ATTEMPT = 1_000  # as AdmitRequest.attempt


def retry_of(headers: Mapping[str, str], tenant: str, body: bytes) -> tuple[str, int]:
    """(retry key, attempt) of a request: the client's ``Idempotency-Key``
    when it sends a usable one, else a digest of the tenant and the body (a
    retry sends the same body again); the attempt from
    ``x-stainless-retry-count`` (0 when absent or not a count). The plane
    judges only retries (attempt > 0) by their key, so two first attempts
    with the same body are two requests. A key that is not printable text
    raises BadHeader; one longer than 128 characters is digested too."""
    given = text_of(headers, IDEMPOTENCY_KEY)
    if 0 < len(given) <= MAX_REQUEST_ID:
        key = given
    else:
        key = "b:" + hashlib.blake2b(tenant.encode() + b"\0" + body, digest_size=16).hexdigest()
    raw = headers.get(RETRY_COUNT, "")
    attempt = int(raw) if raw.isdigit() and len(raw) <= 4 else 0
    return key, min(attempt, MAX_ATTEMPT)


def upstream_headers(
    incoming: Mapping[str, str] | Iterable[tuple[str, str]], *, drop: Iterable[str] = (),
    set_: Mapping[str, str] | None = None,
) -> CIMultiDict[str]:  # fmt: skip
    """The client's headers for the engine: hop-by-hop ones dropped, then
    ``set_`` applied (replacing any of the same name)."""
    dropped = HOP_BY_HOP | {d.lower() for d in drop}
    items = incoming.items() if isinstance(incoming, Mapping) else incoming
    out: CIMultiDict[str] = CIMultiDict((k, v) for k, v in items if k.lower() not in dropped)
    for k, v in (set_ or {}).items():
        out[k] = v
    return out


def response_headers(upstream: Mapping[str, str] | Iterable[tuple[str, str]]) -> CIMultiDict[str]:
    """The engine's response headers for the client (hop-by-hop dropped)."""
    items = upstream.items() if isinstance(upstream, Mapping) else upstream
    return CIMultiDict((k, v) for k, v in items if k.lower() not in HOP_BY_HOP)

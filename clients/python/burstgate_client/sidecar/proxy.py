"""The completions endpoints: admit, rewrite, forward, settle.

One request: its tenant (the API key's mapping, else the tenant header,
else the configured default: 401 otherwise), lane (the lane header, else
the tenant's configured lane, else the server's default for the tenant),
request id (minted here for every request: the reservation's and the
ledger's key; the client's ``x-request-id`` is its correlation id, recorded
in the ledger beside it), prompt tokens (tokens.py)
and max tokens; then ``admit`` waits at most the lane's max wait in
burstgate's gate. Refused: refusal.py's answer. Admitted: the request is
rewritten (rewrite.py), forwarded, its answer relayed (streams event by
event, sse.py) and the request settled in the background with the engine's
usage and the times it ran (exec_start/exec_end, Unix ns). Whatever the
engine answers (an error too) reaches the client unchanged but for the
headers below; a request the engine did not serve is settled with 0
generated. A client that goes away cancels the engine's request and is
settled with what was generated.

Added to every completions answer: ``x-request-id`` (the client's, else
the minted id), ``x-burstgate-request-id`` (the minted id: the ledger's key),
``x-burstgate-pricing-multiplier`` (when the control plane gave one),
``x-burstgate-queue-wait-ms`` (held in the gate), ``x-burstgate-degraded``,
``x-burstgate-offline`` (admitted locally while the control plane was
unreachable), ``x-burstgate-granted-max-tokens`` (when the grant is below
what was asked), ``x-burstgate-evict-below-reuse-per-s`` on admitted answers
(the KV-cache eviction advice of the plane's latest answer to this sidecar's
load report; absent while the last report got none) and the
``x-ratelimit-*`` headers when the tenant's limits are at hand (a tenant's
first request waits up to ``limits_timeout_s`` for its GetLimits, started
beside its Admit; later ones take the cached limits).
With an access log, each request's line is written when its answer ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from burstgate_client.sidecar import headers as H
from burstgate_client.sidecar.accesslog import AccessLog
from burstgate_client.sidecar.admitter import AdmissionLike, Admitter, LimitsLike
from burstgate_client.sidecar.config import SidecarConfig
from burstgate_client.sidecar.metrics import SidecarMetrics
from burstgate_client.sidecar.refusal import json_error, ratelimit_headers, refusal
from burstgate_client.sidecar.rewrite import BadRequest, CompletionRequest, forwarded_body, parse
from burstgate_client.sidecar.sse import StreamRelay, Usage, loads, usage_of
from burstgate_client.sidecar.tokens import TokenCounter

log = logging.getLogger("burstgate.sidecar")

# The Admit call's own budget on top of the lane's max wait in the gate.
ADMIT_CALL_S = 0.25
_CLIENT_GONE = (ConnectionResetError, aiohttp.ClientConnectionResetError)


@dataclass(slots=True)
class Ticket:
    """One request, from its arrival until it is settled; what the access
    log writes of it (accesslog.py) is filled in as it becomes known."""

    request_id: str
    arrived: float  # perf_counter
    tenant: str = ""
    prompt_estimate: int = 0
    correlation_id: str = ""  # the client's x-request-id ("" = none)
    lane: str = ""
    model: str = ""
    stream: bool = False
    outcome: str = ""
    reason: str = ""
    queue_wait_ms: int = 0
    exec_start_ns: int = 0
    first_token_ns: int = 0  # streamed: when the first generated text came (0 = unknown)
    exec_end_ns: int = 0
    prompt_tokens: int = 0  # as settled
    generated_tokens: int = 0
    upstream_status: int = 0  # the engine's answer's (0 = none)
    disconnected: bool = False
    settled: bool = False


class Proxy:
    def __init__(
        self, cfg: SidecarConfig, admitter: Admitter, session: aiohttp.ClientSession,
        counter: TokenCounter, metrics: SidecarMetrics, *,
        stream_count: Callable[[str], int] | None, access: AccessLog | None = None,
    ) -> None:  # fmt: skip
        self.cfg, self.admitter, self.session = cfg, admitter, session
        self.counter, self.metrics = counter, metrics
        self.access = access  # None: no access log (the hot path then writes nothing)
        self.stream_count = stream_count  # the tokenizer, when configured
        self.tasks: set[asyncio.Task[None]] = set()  # settlements under way
        self.draining = False
        # The latest ReportLoad answer's eviction advice, as the header
        # writes it (server.py sets it; None: no answer to the last report).
        self.eviction_advice: str | None = None
        self.limits = LimitsCache(admitter)
        self._urls: dict[str, URL] = {}
        m = metrics
        self._admitted, self._offline = m.requests.labels("admitted"), m.requests.labels("offline")
        self._bad_request = m.requests.labels("bad_request")
        self._delivered = m.settlements.labels("delivered")
        self._status = {n: m.upstream.labels(f"{n}xx") for n in range(1, 6)}

    def _url(self, path_qs: str) -> URL:
        """The engine's URL for a path, parsed once (the two completions
        paths, each with what query string clients send): aiohttp parses a
        string URL on every request."""
        url = self._urls.get(path_qs)
        if url is None:
            if len(self._urls) >= 256:  # query strings are the client's: bounded
                self._urls.clear()
            url = self._urls[path_qs] = URL(self.cfg.upstream + path_qs)
        return url

    # --- who, what ---------------------------------------------------------

    def _tenant(self, request: web.Request) -> str | None:
        """Raises BadHeader for a tenant header that cannot be a tenant id."""
        auth = request.headers.get("authorization", "")
        if auth[:7].lower() == "bearer ":
            tenant = self.cfg.api_keys.get(auth[7:].strip())
            if tenant is not None:
                return tenant
        if self.cfg.tenant_header and (
            t := H.text_of(request.headers, self.cfg.tenant_header, max_len=H.MAX_REQUEST_ID)
        ):
            return t
        return self.cfg.default_tenant

    def _lane(self, request: web.Request, tenant: str) -> str:
        given = H.text_of(request.headers, self.cfg.lane_header) if self.cfg.lane_header else ""
        return given or self.cfg.tenant_lanes.get(tenant, "")

    # --- the handler ---------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=False)

    async def _handle(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        ticket = Ticket(H.new_request_id(), time.perf_counter())
        if self.access is None:
            return await self._serve(request, ticket, chat)
        status = 0
        try:
            resp = await self._serve(request, ticket, chat)
            status = resp.status
            return resp
        except asyncio.CancelledError:  # the client went away
            ticket.disconnected = True
            raise
        finally:
            self._log(request, ticket, status or ticket.upstream_status)

    async def _serve(self, request: web.Request, ticket: Ticket, chat: bool) -> web.StreamResponse:
        rid = ticket.request_id
        ours = {H.REQUEST_ID: rid, H.LEDGER_ID: rid}
        try:
            correlation = ticket.correlation_id = H.correlation_id(request.headers)
            ours[H.REQUEST_ID] = correlation or rid
            tenant = self._tenant(request)
        except H.BadHeader as exc:
            return self._bad(str(exc), None, ours, ticket)
        if tenant is None:
            self._bad_request.inc()
            ticket.outcome = "bad_request"
            return json_error(401, "No tenant: send an API key the sidecar knows (Authorization: "
                              "Bearer ...) or a tenant header.", "invalid_request_error",
                              "invalid_api_key", headers=ours)  # fmt: skip
        ticket.tenant = tenant
        try:
            raw = await read_body(request, self.cfg.max_body_bytes)
        except BodyTooLarge as exc:
            self._bad_request.inc()
            ticket.outcome = "bad_request"
            return exc.response(ours)
        try:
            req = parse(raw, chat=chat)
            lane = ticket.lane = self._lane(request, tenant)
            retry_key, attempt = H.retry_of(request.headers, tenant, raw)
        except BadRequest as exc:
            return self._bad(str(exc), exc.param, ours, ticket)
        except H.BadHeader as exc:
            return self._bad(str(exc), None, ours, ticket)
        ticket.model, ticket.stream = req.model, req.stream
        prompt = ticket.prompt_estimate = self.counter.prompt_tokens(req.body, chat)
        # The tenant's limits (x-ratelimit-*): the cached ones, or a GetLimits
        # started now, beside the Admit, for a tenant not asked about yet.
        limits = self.limits.get(tenant)
        asked = req.admit_max_tokens(self.cfg.default_max_tokens)
        try:
            a = await self.admitter.admit(
                tenant, rid, prompt_tokens=prompt, max_tokens=asked, lane=lane,
                model=req.model, pool=self.cfg.pool,
                deadline_s=self.cfg.lane(lane).max_wait_ms / 1000 + ADMIT_CALL_S,
                retry_key=retry_key, attempt=attempt,
            )  # fmt: skip
        except ValueError as exc:  # the SDK's check of an argument (names it)
            return self._bad(str(exc), None, ours, ticket)
        admitted_at = time.perf_counter()
        self.metrics.admit_seconds.observe(admitted_at - ticket.arrived)
        ticket.queue_wait_ms = a.queue_wait_ms
        ours.update(H.admission_headers(a))
        if not a.admitted:
            return await self._refuse(a, ticket, ours[H.REQUEST_ID], ours)  # the id it knows
        ticket.outcome = "offline" if a.offline else "admitted"
        if self.eviction_advice is not None:
            ours[H.EVICT_BELOW] = self.eviction_advice
        (self._offline if a.offline else self._admitted).inc()
        if limits is None:  # the tenant's first request: answered meanwhile, or soon
            limits = (
                self.limits.get(tenant)
                if self.limits.answered(tenant)
                else await self.limits.fetch(tenant, self.cfg.limits_timeout_s)
            )
        body = forwarded_body(req, granted_max_tokens=a.granted_max_tokens,
                              fallback_model=a.fallback_model,
                              default_max=self.cfg.default_max_tokens)  # fmt: skip
        if 0 < a.granted_max_tokens < asked:  # capped: the engine's max_tokens, per choice
            ours[H.GRANTED_MAX_TOKENS] = str(max(1, a.granted_max_tokens // req.choices))
        self.metrics.inflight.inc()
        try:
            return await self._forward(request, req, body, ticket, a, ours, limits)
        finally:
            self.metrics.inflight.dec()

    def _bad(
        self, message: str, param: str | None, ours: dict[str, str], ticket: Ticket
    ) -> web.Response:
        self._bad_request.inc()
        ticket.outcome = "bad_request"
        return json_error(400, message, "invalid_request_error", None, param=param, headers=ours)

    def _log(self, request: web.Request, t: Ticket, status: int) -> None:
        assert self.access is not None
        end_ns = t.exec_end_ns or time.time_ns()
        self.access.write(
            request_id=t.request_id, correlation_id=t.correlation_id or None,
            path=request.path, tenant=t.tenant or None, lane=t.lane or None,
            model=t.model or None, stream=t.stream, status=status or None,
            outcome=t.outcome or None, reason=t.reason or None, queue_wait_ms=t.queue_wait_ms,
            prompt_tokens=t.prompt_tokens if t.settled else (t.prompt_estimate or None),
            generated_tokens=t.generated_tokens if t.settled else None,
            upstream_ms=round((end_ns - t.exec_start_ns) / 1e6, 3) if t.exec_start_ns else None,
            total_ms=round((time.perf_counter() - t.arrived) * 1000, 3),
            client_disconnected=t.disconnected,
        )  # fmt: skip

    async def _refuse(
        self, a: AdmissionLike, ticket: Ticket, rid: str, ours: dict[str, str]
    ) -> web.Response:
        tenant = ticket.tenant
        outcome = ticket.outcome = "unavailable" if a.reason == "unavailable" else "refused"
        ticket.reason = a.reason or "unknown"
        self.metrics.requests.labels(outcome).inc()
        self.metrics.refusals.labels(ticket.reason).inc()
        limits: LimitsLike | None = None
        if outcome == "refused":
            limits = await self.limits.fetch(tenant, self.cfg.limits_timeout_s)
        resp = refusal(a, tenant=tenant, request_id=rid, limits=limits,
                       unavailable_retry_after_ms=self.cfg.unavailable_retry_after_s * 1000)
        resp.headers.update(ours)
        return resp

    # --- forwarding ----------------------------------------------------------

    async def _forward(
        self, request: web.Request, req: CompletionRequest, body: bytes, ticket: Ticket,
        a: AdmissionLike, ours: dict[str, str], limits: LimitsLike | None,
    ) -> web.StreamResponse:  # fmt: skip
        set_ = {H.REQUEST_ID: ticket.request_id, "accept-encoding": "identity",
                "content-type": "application/json"}  # fmt: skip
        if self.cfg.upstream_api_key is not None:
            set_["authorization"] = f"Bearer {self.cfg.upstream_api_key}"
        up_headers = H.upstream_headers(request.headers, set_=set_)
        url = self._url(request.rel_url.path_qs)
        relay: StreamRelay | None = None
        # the sidecar's own time so far: since the arrival, less the gate's hold
        self.metrics.overhead_seconds.observe(
            max(0.0, time.perf_counter() - ticket.arrived - a.queue_wait_ms / 1000)
        )
        ticket.exec_start_ns = time.time_ns()
        try:
            async with self.session.post(url, data=body, headers=up_headers) as resp:
                self._status.get(resp.status // 100, self._status[5]).inc()
                ticket.upstream_status = resp.status
                headers = H.response_headers(resp.headers)
                headers.update(ours)
                headers.update(ratelimit_headers(a, limits))
                if self.draining:
                    headers["connection"] = "close"
                streamed = resp.headers.get("content-type", "").startswith("text/event-stream")
                if req.stream and resp.status == 200 and streamed:
                    relay = StreamRelay(strip_usage=not req.client_wants_usage,
                                        count=self.stream_count)  # fmt: skip
                    return await self._relay(request, resp, relay, headers, ticket)
                data = await resp.read()
                usage = _json_usage(data) if resp.status == 200 else None
                self._settle(ticket, usage, 0)
                return web.Response(status=resp.status, body=data, headers=headers)
        except asyncio.CancelledError:  # the client went away (aiohttp cancels the handler)
            self.metrics.disconnects.inc()
            ticket.disconnected = True
            self._settle(ticket, relay.usage if relay else None,
                         relay.generated_estimate if relay else 0)  # fmt: skip
            raise
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.metrics.upstream.labels("error").inc()
            self._settle(ticket, relay.usage if relay else None,
                         relay.generated_estimate if relay else 0)  # fmt: skip
            if relay is not None:  # the stream had started: it just ends
                raise
            log.warning("engine unreachable for %s: %r", ticket.request_id, exc)
            return json_error(502, f"The engine did not answer: {exc!r}"[:300], "server_error",
                              "upstream_unavailable", headers=ours)  # fmt: skip

    async def _relay(
        self, request: web.Request, resp: aiohttp.ClientResponse, relay: StreamRelay,
        headers: CIMultiDict[str], ticket: Ticket,
    ) -> web.StreamResponse:  # fmt: skip
        out = web.StreamResponse(status=resp.status, headers=headers)
        try:
            await out.prepare(request)
            async for data in resp.content.iter_any():
                chunk = relay.feed(data)
                if not ticket.first_token_ns and relay.text_chunks:
                    ticket.first_token_ns = time.time_ns()  # what the client's TTFT is
                if chunk:
                    await out.write(chunk)
            if tail := relay.flush():
                await out.write(tail)
            await out.write_eof()
        except _CLIENT_GONE:
            self.metrics.disconnects.inc()
            ticket.disconnected = True
            resp.close()  # drops the engine's connection: vLLM aborts the request
        self._settle(ticket, relay.usage, relay.generated_estimate)
        return out

    # --- settlement ----------------------------------------------------------

    def _settle(self, ticket: Ticket, usage: Usage | None, generated_estimate: int) -> None:
        """Complete in the background (the answer does not wait for it)."""
        if ticket.settled:
            return
        ticket.settled = True
        end = ticket.exec_end_ns = time.time_ns()
        if usage is not None:
            prompt, generated = usage.prompt_tokens, usage.completion_tokens
            cached = usage.cached_tokens
        else:
            prompt, generated, cached = ticket.prompt_estimate, generated_estimate, 0
        ticket.prompt_tokens, ticket.generated_tokens = prompt, generated
        task = asyncio.get_running_loop().create_task(self._complete(
            ticket, prompt=prompt, generated=generated, cached=cached, end=end,
        ))  # fmt: skip
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _complete(
        self, ticket: Ticket, *, prompt: int, generated: int, cached: int, end: int
    ) -> None:
        try:
            c = await self.admitter.complete(
                ticket.tenant, ticket.request_id, prompt_tokens=prompt,
                generated_tokens=generated, cached_prompt_tokens=cached,
                exec_start_unix_ns=ticket.exec_start_ns, exec_end_unix_ns=end,
                first_token_unix_ns=ticket.first_token_ns,
                correlation_id=ticket.correlation_id,
            )  # fmt: skip
        except Exception:
            self.metrics.settlements.labels("failed").inc()
            log.exception("Complete failed for %s/%s", ticket.tenant, ticket.request_id)
            return
        (self._delivered if c.delivered else self.metrics.settlements.labels("buffered")).inc()


class BodyTooLarge(Exception):
    """A request body over the sidecar's ``max_body_bytes``: 413."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"The request body is larger than {limit:,} bytes, the most this "
                         "sidecar accepts (max_body_bytes).")  # fmt: skip

    def response(self, headers: dict[str, str] | None = None) -> web.Response:
        # the connection closes after the answer: the rest of the body is
        # discarded as it comes (aiohttp's lingering close), never kept
        resp = json_error(413, str(self), "invalid_request_error", "request_too_large",
                          headers=headers)  # fmt: skip
        resp.force_close()
        return resp


async def read_body(request: web.Request, limit: int) -> bytes:
    """The request's body, at most ``limit`` bytes: a larger declared
    Content-Length is refused before anything is read; a chunked (or
    compressed) body is read only until it passes the limit (aiohttp's
    ``client_max_size``, set to the same limit). Raises BodyTooLarge."""
    if request.content_length is not None and request.content_length > limit:
        raise BodyTooLarge(limit)
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise BodyTooLarge(limit) from None


def _json_usage(data: bytes) -> Usage | None:
    try:
        return usage_of(loads(data))
    except ValueError:  # JSONDecodeError, UnicodeDecodeError
        return None


class LimitsCache:
    """The tenants' limits for the rate-limit headers. An admitted answer
    takes the last one known, refreshed in the background at most every
    ``ttl_s`` (it never waits for GetLimits; a tenant's first answer goes
    without them); a refusal waits for a fresh one, briefly."""

    MAX_TENANTS = 10_000  # tenants may come from a header: bounded

    def __init__(self, admitter: Admitter, ttl_s: float = 2.0) -> None:
        self.admitter, self.ttl_s = admitter, ttl_s
        self._known: dict[str, tuple[float, LimitsLike | None]] = {}
        self._refreshing: dict[str, asyncio.Task[LimitsLike | None]] = {}

    def answered(self, tenant: str) -> bool:
        """Whether GetLimits has answered for ``tenant`` (its limits, or that
        there are none to show)."""
        return tenant in self._known

    def get(self, tenant: str) -> LimitsLike | None:
        known = self._known.get(tenant)
        if (known is None or time.monotonic() - known[0] > self.ttl_s) and (
            tenant not in self._refreshing
        ):
            self._refresh(tenant)
        return known[1] if known is not None else None

    async def fetch(self, tenant: str, timeout_s: float) -> LimitsLike | None:
        task = self._refreshing.get(tenant) or self._refresh(tenant)
        with contextlib.suppress(Exception):  # timed out, or failed: what is known
            return await asyncio.wait_for(asyncio.shield(task), timeout_s)
        known = self._known.get(tenant)
        return known[1] if known is not None else None

    def _refresh(self, tenant: str) -> asyncio.Task[LimitsLike | None]:
        task = asyncio.get_running_loop().create_task(self.admitter.limits(tenant))
        self._refreshing[tenant] = task
        task.add_done_callback(lambda t: self._done(tenant, t))
        return task

    def _done(self, tenant: str, task: asyncio.Task[LimitsLike | None]) -> None:
        self._refreshing.pop(tenant, None)
        if task.cancelled() or task.exception() is not None:
            return  # a failed GetLimits is only missing headers
        if len(self._known) >= self.MAX_TENANTS:
            self._known.clear()
        self._known[tenant] = (time.monotonic(), task.result())

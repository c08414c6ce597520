"""The sidecar's HTTP server: the completions endpoints (proxy.py), every
other path passed through to the engine, its own ``/metrics`` and
``/health``, the engine's load reports, and a shutdown that drains.

HTTP stack: aiohttp, server and client: already the fake engine's and the
load generator's, mature (a decade of releases), asyncio-native with
streaming on both sides, and its handler cancellation tells the proxy when
a client goes away, so the engine's request is cancelled at once.

Shutdown (``stop``, SIGTERM in the CLI): the listening socket closes (new
connections are refused), answers in flight get ``connection: close``,
requests in flight (streams too) have ``drain_timeout_s`` to finish, then
are cancelled (and settled with what they generated); settlements under
way finish, and the admission client flushes what it buffered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from burstgate_client.sidecar import headers as H
from burstgate_client.sidecar.accesslog import AccessLog
from burstgate_client.sidecar.admitter import Admitter
from burstgate_client.sidecar.config import SidecarConfig
from burstgate_client.sidecar.metrics import SidecarMetrics
from burstgate_client.sidecar.proxy import BodyTooLarge, Proxy, read_body
from burstgate_client.sidecar.scrape import LoadReader
from burstgate_client.sidecar.tokens import TokenCounter, estimate, load_tokenizer

log = logging.getLogger("burstgate.sidecar")
HEALTH_TIMEOUT_S = 1.0


class Sidecar:
    """``await start()`` binds ``host:port`` (0 = a free port) and returns
    the port; ``await stop()`` drains and closes. ``admitter`` is the
    admission client (the SDK's ``AsyncAdmissionClient``); its owner closes
    it after ``stop`` (which lets the settlements in flight reach it)."""

    def __init__(self, cfg: SidecarConfig, admitter: Admitter) -> None:
        self.cfg = cfg
        self.admitter = admitter
        count: Callable[[str], int] | None = (
            load_tokenizer(cfg.tokenizer) if cfg.tokenizer is not None else None
        )
        self.counter = TokenCounter(count or estimate)
        self.reader = LoadReader(cfg.metrics, pool=cfg.pool,
                                 engine_id=cfg.metrics.engine_id or urlsplit(cfg.upstream).netloc)
        self.metrics = SidecarMetrics(lambda: float(self.admitter.pending_completions))
        self._exposition = self.metrics.exposition()
        # Opened last: nothing after it can fail and leave the file open.
        self.access = AccessLog(cfg.access_log) if cfg.access_log is not None else None
        self.port = cfg.port
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._scraper: asyncio.Task[None] | None = None
        self._stream_count = count
        self.proxy: Proxy | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.cfg.host}:{self.port}/v1"

    async def start(self) -> int:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.cfg.upstream_max_connections),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10,
                                          sock_read=self.cfg.upstream_timeout_s),
            auto_decompress=False,  # passed-through bodies go as they came
            cookie_jar=aiohttp.DummyCookieJar(),  # a proxy keeps no cookies (and saves ~10 %)
        )  # fmt: skip
        self.proxy = Proxy(self.cfg, self.admitter, self._session, self.counter, self.metrics,
                           stream_count=self._stream_count, access=self.access)  # fmt: skip
        app = web.Application(client_max_size=self.cfg.max_body_bytes)
        app.router.add_post("/v1/chat/completions", self.proxy.chat)
        app.router.add_post("/v1/completions", self.proxy.completions)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        app.router.add_route("*", "/{tail:.*}", self._passthrough)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                                     shutdown_timeout=self.cfg.drain_timeout_s)  # fmt: skip
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.cfg.host, self.cfg.port, reuse_address=False)
        try:
            await site.start()
        except OSError:
            await self._close_session()
            self._close_access_log()
            raise
        server = site._server  # the bound socket: port 0 resolves here
        assert server is not None and server.sockets  # type: ignore[attr-defined]
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        if self.cfg.metrics.enabled:
            self._scraper = asyncio.create_task(self._scrape_loop(), name="sidecar-scrape")
        return self.port

    async def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.draining = True
        if self._scraper is not None:
            self._scraper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._scraper
        if self._runner is not None:
            await self._runner.cleanup()  # waits for handlers up to drain_timeout_s
        if self.proxy is not None and self.proxy.tasks:
            await asyncio.wait(set(self.proxy.tasks), timeout=max(1.0, self.cfg.drain_timeout_s))
        await self._close_session()
        self._close_access_log()  # after the handlers: they write the last lines

    def _close_access_log(self) -> None:
        if self.access is not None:
            self.access.close()
            self.access = None

    async def _close_session(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # --- its own endpoints ---------------------------------------------------

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self._exposition),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})  # fmt: skip

    async def _health(self, _: web.Request) -> web.Response:
        """200 while serving and the engine answers its /health; 503 while
        draining or when the engine does not (the control plane's state is
        not a reason: the lanes' fail policies answer for it)."""
        body = {"status": "ok", "pending_completions": self.admitter.pending_completions}
        if self.proxy is None or self.proxy.draining:
            return web.json_response({**body, "status": "draining"}, status=503)
        assert self._session is not None
        try:
            timeout = aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)
            async with self._session.get(self.cfg.upstream + "/health", timeout=timeout) as r:
                ok = r.status == 200
        except (aiohttp.ClientError, TimeoutError):
            ok = False
        if not ok:
            return web.json_response({**body, "status": "engine_unavailable"}, status=503)
        return web.json_response(body)

    async def _passthrough(self, request: web.Request) -> web.StreamResponse:
        """Any other path, to the engine and back as it is."""
        assert self._session is not None
        self.metrics.passthrough.inc()
        headers = H.upstream_headers(request.headers)
        if self.cfg.upstream_api_key is not None:
            headers["authorization"] = f"Bearer {self.cfg.upstream_api_key}"
        url = self.cfg.upstream + request.rel_url.path_qs
        data = None
        if request.body_exists:
            try:
                data = await read_body(request, self.cfg.max_body_bytes)
            except BodyTooLarge as exc:
                return exc.response()
        try:
            async with self._session.request(request.method, url, data=data,
                                             headers=headers) as resp:  # fmt: skip
                out = web.StreamResponse(status=resp.status, reason=resp.reason,
                                         headers=H.response_headers(resp.headers))  # fmt: skip
                await out.prepare(request)
                async for chunk in resp.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out
        except (aiohttp.ClientError, TimeoutError) as exc:
            return web.json_response(
                {"error": {"message": f"The engine did not answer: {exc!r}"[:300],
                           "type": "server_error", "param": None,
                           "code": "upstream_unavailable"}}, status=502,
            )  # fmt: skip

    # --- load reports --------------------------------------------------------

    async def _scrape_loop(self) -> None:
        """Scrape the engine every interval and send the report. A scrape
        or report that fails is skipped: the pool's report goes stale at
        the control plane, which then applies its stale policy."""
        m = self.cfg.metrics
        url = m.url or self.cfg.upstream + "/metrics"
        timeout = aiohttp.ClientTimeout(total=max(1.0, m.interval_s * 5))
        loop = asyncio.get_running_loop()
        warned = 0.0
        while True:
            began = loop.time()
            try:
                await self._scrape_once(url, timeout)
            except Exception as exc:  # a bad report: say so, at most once a minute
                self.metrics.load_reports.labels("rejected").inc()
                self._no_advice()
                if time.monotonic() - warned > 60:
                    warned = time.monotonic()
                    log.warning("load report not sent: %r", exc)
            await asyncio.sleep(max(0.0, m.interval_s - (loop.time() - began)))

    def _no_advice(self) -> None:
        if self.proxy is not None:
            self.proxy.eviction_advice = None

    async def _scrape_once(self, url: str, timeout: aiohttp.ClientTimeout) -> None:
        assert self._session is not None
        try:
            async with self._session.get(url, timeout=timeout,
                                         headers={"accept-encoding": "identity"}) as r:
                r.raise_for_status()
                text = await r.text()
        except (aiohttp.ClientError, TimeoutError):
            self.metrics.load_reports.labels("scrape_failed").inc()
            self._no_advice()
            return
        report = self.reader.report(text)
        if report is None:
            self.metrics.load_reports.labels("no_queue_depth").inc()
            self._no_advice()
            return
        ack = await self.admitter.report_load(report)
        self.metrics.load_reports.labels("sent" if ack is not None else "unreachable").inc()
        if self.proxy is not None:  # advice the plane did not renew is not passed on
            self.proxy.eviction_advice = (
                None if ack is None else format(ack.evict_below_reuse_per_s, "g")
            )

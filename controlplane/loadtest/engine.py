"""The load generator as a sidecar in front of a fake engine (``loadtest
--local``): an admitted request is sent to the engine over HTTP (the
OpenAI completions API, its lengths in the fake engine's hint headers) and
Completed with the usage the engine reports; and the engine's state goes to
the control plane as load reports, so that the pool gate releases held
requests while the modelled engine has room, as it would in front of vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
import grpc
from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb

from controlplane.fakeengine import FakeEngine
from controlplane.fakeengine.app import OUTPUT_TOKENS_HEADER, PROMPT_TOKENS_HEADER
from controlplane.loadtest.profile import Arrival

REPORT_INTERVAL_S = 0.1  # llm-d treats load metrics older than 200 ms as stale
POOL = "default"  # the pool of requests that name none (the demo's)


@dataclass(frozen=True, slots=True)
class Served:
    prompt_tokens: int
    generated_tokens: int
    cached_tokens: int
    start_ns: int
    end_ns: int


class EngineLink:
    """One in-process fake engine, its HTTP client and its load reports."""

    def __init__(self, engine: FakeEngine, engine_id: str = "fake-engine-0") -> None:
        self.engine = engine
        self.engine_id = engine_id
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> EngineLink:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),  # open loop: no client-side cap
            timeout=aiohttp.ClientTimeout(total=None),
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    async def serve(self, a: Arrival, max_tokens: int) -> Served:
        """Run the request on the engine; the usage it reports."""
        assert self._session is not None
        body = {"model": self.engine.cfg.model, "prompt": "load", "max_tokens": max_tokens}
        headers = {PROMPT_TOKENS_HEADER: str(a.prompt_tokens),
                   OUTPUT_TOKENS_HEADER: str(a.max_tokens)}  # fmt: skip
        start = time.time_ns()
        url = f"{self.engine.base_url}/completions"
        async with self._session.post(url, json=body, headers=headers) as resp:
            resp.raise_for_status()
            usage = (await resp.json())["usage"]
        return Served(
            usage["prompt_tokens"], usage["completion_tokens"],
            usage.get("prompt_tokens_details", {}).get("cached_tokens", 0), start, time.time_ns(),
        )  # fmt: skip

    def report(self) -> pb.LoadReport:
        """The engine's state now, as a sidecar reports a vLLM's."""
        live = self.engine.live
        e, p = live.engine, live.params
        return pb.LoadReport(
            pool=POOL, engine_id=self.engine_id, batch_tokens=e.last_batch_tokens,
            max_batch_tokens=p.max_num_batched_tokens, queue_depth=e.num_waiting,
            queue_capacity=0, requests_running=e.num_running, max_num_seqs=p.max_num_seqs,
            kv_cache_usage=e.kv_usage,
        )  # fmt: skip


async def report_loop(link: EngineLink, send: Callable[..., Awaitable[pb.LoadReportAck]]) -> None:
    """Send ``link.report()`` every REPORT_INTERVAL_S through ``send`` (the
    stub's ``ReportLoad``), for ever (cancel to stop). A report that fails
    is skipped: it goes stale, as a sidecar's would."""
    while True:
        with contextlib.suppress(grpc.aio.AioRpcError):
            await send(link.report(), timeout=5)
        await asyncio.sleep(REPORT_INTERVAL_S)

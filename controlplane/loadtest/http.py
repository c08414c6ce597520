"""Load through an HTTP sidecar (``loadtest --via-sidecar``): each arrival is
an OpenAI ``/v1/completions`` request (streamed) to a burstgate sidecar at
its time, open loop, instead of an ``Admit`` over gRPC. The sidecar admits
it, forwards it to its engine and settles it; the load generator sees what
an application sees.

What the report's columns mean here: the *latency* is the time to the
answer's headers (the admission, any wait in burstgate's gate, and the
engine accepting the request: a streamed answer's headers come before its
first token); *decision* is ``admit`` for a 200 and ``reject`` for a
refusal (its reason from the ``x-burstgate-reason`` header); the *queue
wait* is ``x-burstgate-queue-wait-ms``; *completed* counts the answers read
to their end (the sidecar settles them). Any other answer is an error named
by its status (``http_502``) or the client's exception.

Each request carries its tenant in the sidecar's tenant header (the sidecar
must have ``tenant_header`` set: a trusted client), its lane in
``x-burstgate-lane``, a prompt of exactly its token count by the sidecar's
estimate (4 bytes a token), and the fake engine's hint headers, so that the
engine's usage is the plan's lengths.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from burstgate_client.sidecar import Sidecar, load
from burstgate_client.sidecar.sdkclient import sdk_client

from controlplane.fakeengine import FakeEngine
from controlplane.fakeengine.app import OUTPUT_TOKENS_HEADER, PROMPT_TOKENS_HEADER
from controlplane.loadtest.profile import Arrival
from controlplane.loadtest.run import SAMPLE_S, Outcome, RunResult

TENANT_HEADER = "x-burstgate-tenant"
LANE_HEADER = "x-burstgate-lane"
REASON_HEADER = "x-burstgate-reason"
QUEUE_WAIT_HEADER = "x-burstgate-queue-wait-ms"


def prompt_text(tokens: int) -> str:
    """Text the sidecar counts as ``tokens`` tokens (4 bytes each)."""
    return "tok " * max(1, tokens)


async def run_http(
    url: str,
    plan: list[Arrival],
    *,
    model: str = "fake-llama",
    tenant_header: str = TENANT_HEADER,
    run_id: str = "",
    max_in_flight: int = 10_000,
    on_tick: Callable[[float, int], None] | None = None,
) -> RunResult:
    """Send ``plan`` (sorted by time) to the sidecar at ``url`` (its origin)
    and return every outcome once every answer has ended."""
    run_id = run_id or f"lt{int(time.time())}"
    outcomes = [Outcome(a) for a in plan]
    result = RunResult(outcomes, 0.0)
    waiting = serving = 0
    endpoint = url.rstrip("/") + "/v1/completions"
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                    timeout=aiohttp.ClientTimeout(total=None))  # fmt: skip
    start = time.monotonic()

    async def one(i: int, o: Outcome) -> None:
        nonlocal waiting, serving
        a = o.arrival
        o.request_id = f"{run_id}-{i}"
        headers = {tenant_header: a.tenant.tenant_id, "x-request-id": o.request_id,
                   PROMPT_TOKENS_HEADER: str(a.prompt_tokens),
                   OUTPUT_TOKENS_HEADER: str(a.max_tokens)}  # fmt: skip
        if a.tenant.lane:
            headers[LANE_HEADER] = a.tenant.lane
        body = {"model": model, "prompt": prompt_text(a.prompt_tokens),
                "max_tokens": a.max_tokens, "stream": True}  # fmt: skip
        waiting += 1
        answered = False
        t0 = time.perf_counter()
        try:
            async with session.post(endpoint, json=body, headers=headers) as resp:
                answered = True
                waiting -= 1
                o.latency_ms = (time.perf_counter() - t0) * 1000
                o.queue_wait_ms = int(resp.headers.get(QUEUE_WAIT_HEADER, "0") or 0)
                reason = resp.headers.get(REASON_HEADER)
                if resp.status == 200:
                    o.decision = "admit"
                    serving += 1
                    try:
                        await resp.read()  # served to its end; the sidecar settles it
                        o.completed = True
                    finally:
                        serving -= 1
                elif reason:
                    o.decision, o.reason = "reject", reason
                else:
                    o.error = f"http_{resp.status}"
        except aiohttp.ClientError as exc:
            if o.decision == "admit":
                result.engine_errors += 1  # the answer broke off
            else:
                o.error = type(exc).__name__
        finally:
            if not answered:
                waiting -= 1

    async def sample() -> None:
        while True:
            t = time.monotonic() - start
            result.samples.append((t, waiting, serving))
            if on_tick is not None:
                on_tick(t, sum(1 for o in outcomes if o.sent_s > 0))
            await asyncio.sleep(SAMPLE_S)

    sampler = asyncio.create_task(sample())
    tasks: list[asyncio.Task[None]] = []
    try:
        for i, o in enumerate(outcomes):
            delay = o.arrival.at_s - (time.monotonic() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            o.sent_s = max(1e-9, time.monotonic() - start)
            if waiting + serving >= max_in_flight:
                o.error = "dropped"
                continue
            tasks.append(asyncio.create_task(one(i, o)))
        if tasks:
            await asyncio.wait(tasks)
        result.duration_s = time.monotonic() - start
    finally:
        sampler.cancel()
        await session.close()
    return result


async def through_local_sidecar(
    target: str, plan: list[Arrival], *, speed: float, api_key: str | None,
    say: Callable[[str], None], **http_kw: Any,
) -> RunResult:  # fmt: skip
    """``loadtest --local --via-sidecar``: a fake engine at ``speed`` and a
    sidecar in front of it (admitting with the control plane at ``target``,
    tenants from the tenant header, the engine's load reported), started
    here for the run and stopped after it."""
    engine = FakeEngine(port=0, speed=speed)
    await engine.start()
    p = engine.live.params
    # spool=False: a sidecar for one run leaves no spool file in the working directory
    cfg = load(upstream=f"http://127.0.0.1:{engine.port}", control_plane=target, port=0,
               control_plane_api_key=api_key, tenant_header=TENANT_HEADER, spool=False,
               metrics={"interval_s": 0.1, "max_num_seqs": p.max_num_seqs,
                        "max_batch_tokens": p.max_num_batched_tokens})  # fmt: skip
    admitter = sdk_client(cfg)
    server = Sidecar(cfg, admitter)
    await server.start()
    say(f"started a fake engine on {engine.base_url} and a sidecar in front of it on "
        f"{server.base_url}")  # fmt: skip
    try:
        return await run_http(f"http://127.0.0.1:{server.port}", plan, model=engine.cfg.model,
                              **http_kw)  # fmt: skip
    finally:
        await server.stop()
        await admitter.aclose()
        await engine.stop()
        say("stopped the sidecar and the fake engine")

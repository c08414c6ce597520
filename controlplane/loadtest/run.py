"""Open-loop load against a running control plane over gRPC.

Each arrival is one ``Admit`` at its time, whatever the answers before it
(open loop: a slow server does not slow the load down, as real traffic
does not). An admitted request is ``Complete``d after a simulated service
time, so that reservations are refunded as in production: prefill at
``PREFILL_TPS`` then ``DECODE_TPS`` tokens per second for its output,
times ``service_scale``. When the run ends, what is still being "served"
is completed at once with the tokens generated so far.

With an ``engine`` (``loadtest --local``) an admitted request is served by
a fake engine over HTTP instead, Completed with the usage it reports, and
the engine's state is sent as load reports every 100 ms (loadtest/engine.py);
when the profile ends, what the engine is still serving gets ``DRAIN_S`` to
finish before it is cancelled (and settled with its prompt alone).

With ``batch_window_s`` the Admits go micro-batched onto one AdmitStream
(loadtest/stream.py), as a busy sidecar sends them; a batch is answered at
once (never held), so the gate refuses what it would have held.

Calls the server holds (the pool gate's queue) are simply calls in flight:
their count over time is the report's queue depth, and the answer's
``queue_wait_ms`` the server-side wait.
"""

from __future__ import annotations

import asyncio
import ipaddress
import random
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
from burstgate_client._proto.burstgate.v1 import admission_pb2_grpc as pb_grpc

from controlplane.loadtest.engine import EngineLink, report_loop
from controlplane.loadtest.profile import Arrival
from controlplane.loadtest.stream import Answer, StreamBatcher, answer_of

PREFILL_TPS = 20_000.0
DECODE_TPS = 60.0
TTFT_BASE_S = 0.05
ADMIT_DEADLINE_S = 30.0
SAMPLE_S = 0.1
DRAIN_S = 30.0  # engine mode: how long requests on the engine may finish after the run


@dataclass(slots=True)
class Outcome:
    """One request: what was asked, what came back, how long it took."""

    arrival: Arrival
    sent_s: float = 0.0  # since the start of the run
    latency_ms: float = -1.0
    decision: str = ""  # admit | reject | ... ; "" on an error
    reason: str = ""
    queue_wait_ms: int = 0
    error: str = ""  # the gRPC status code name, or "dropped" (client at --max-in-flight)
    completed: bool = False
    request_id: str = ""  # of the attempt that was admitted (or the last one)
    retries: int = 0  # Admits sent again after a retryable refusal
    gave_up: bool = False  # refused, and a retry could no longer meet the request's SLO
    served_after_refusal: bool = False


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Clients that retry a retryable refusal: after ``max(retry_after,
    full-jitter exponential backoff)`` (the ceiling ``base_s`` doubling per
    attempt, up to ``cap_s``), never once the retry would land after the
    request's own TTFT SLO (by lane) has passed. As the simulator's clients
    (controlplane/sim/harness.py) do."""

    slo_s: dict[str, float]
    base_s: float = 0.5
    cap_s: float = 8.0
    seed: int = 0

    def slo_for(self, lane: str) -> float:
        return self.slo_s.get(lane, max(self.slo_s.values()))


@dataclass
class RunResult:
    outcomes: list[Outcome]
    duration_s: float
    # Per SAMPLE_S: (t since start, Admit calls in flight, served in flight).
    samples: list[tuple[float, int, int]] = field(default_factory=list)
    complete_errors: int = 0
    engine_errors: int = 0
    batches: int = 0  # AdmitBatches sent (stream mode)


def check_loopback(target: str) -> None:
    """Load goes to this machine only: refuse any other target."""
    host = target.rsplit(":", 1)[0].strip("[]") if ":" in target else target
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError as exc:
        raise ValueError(f"--target: cannot resolve {host!r}: {exc}") from None
    for info in infos:
        if not ipaddress.ip_address(info[4][0]).is_loopback:
            raise ValueError(
                f"--target: {target} is not a loopback address; the load generator only "
                "sends to this machine (127.0.0.1, ::1, localhost)"
            )


def service_seconds(prompt: int, output: int, scale: float) -> float:
    return (TTFT_BASE_S + prompt / PREFILL_TPS + output / DECODE_TPS) * scale


async def run(
    target: str,
    plan: list[Arrival],
    *,
    api_key: str | None = None,
    service_scale: float = 1.0,
    max_in_flight: int = 10_000,
    run_id: str = "",
    retry: RetryPolicy | None = None,
    engine: EngineLink | None = None,
    batch_window_s: float | None = None,
    batch_max: int = 100,
    on_tick: Callable[[float, int], None] | None = None,
) -> RunResult:
    """Send ``plan`` (sorted by time) and return every outcome."""
    meta = (("authorization", f"Bearer {api_key}"),) if api_key else None
    run_id = run_id or f"lt{int(time.time())}"
    outcomes = [Outcome(a) for a in plan]
    serving: dict[int, asyncio.Task[None]] = {}
    in_flight = 0
    result = RunResult(outcomes, 0.0)
    ended = asyncio.Event()
    drained = asyncio.Event()
    rng = random.Random(retry.seed if retry else 0)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.AdmissionServiceStub(channel)
        start = time.monotonic()

        async def on_engine(o: Outcome, max_tokens: int) -> pb.CompleteRequest:
            """Serve on the engine; the settlement of what it reports (the
            prompt alone when the run ends first or the engine fails)."""
            assert engine is not None
            a = o.arrival
            settle = pb.CompleteRequest(prompt_tokens=a.prompt_tokens)
            serve = asyncio.create_task(engine.serve(a, max_tokens))
            stop = asyncio.create_task(drained.wait())
            await asyncio.wait({serve, stop}, return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            if not serve.done():
                serve.cancel()  # the client goes away: the engine aborts it
            elif serve.exception() is None:
                got = serve.result()
                settle = pb.CompleteRequest(
                    prompt_tokens=got.prompt_tokens, generated_tokens=got.generated_tokens,
                    cached_prompt_tokens=got.cached_tokens, exec_start_unix_ns=got.start_ns,
                    exec_end_unix_ns=got.end_ns,
                )  # fmt: skip
            else:
                result.engine_errors += 1
            return settle

        async def complete(i: int, o: Outcome, granted: int, service_s: float) -> None:
            began = time.monotonic()
            generated = o.arrival.max_tokens if granted <= 0 else min(granted, o.arrival.max_tokens)
            if engine is not None:
                settle = await on_engine(o, generated)
            else:
                try:
                    await asyncio.wait_for(ended.wait(), timeout=service_s)
                    # the run ended first: settle what was generated so far
                    share = min(1.0, (time.monotonic() - began) / service_s) if service_s else 1.0
                    generated = int(generated * share)
                except TimeoutError:
                    pass  # served in full
                settle = pb.CompleteRequest(
                    prompt_tokens=o.arrival.prompt_tokens, generated_tokens=generated
                )
            settle.tenant_id = o.arrival.tenant.tenant_id
            settle.request_id = o.request_id
            try:
                await stub.Complete(settle, timeout=ADMIT_DEADLINE_S, metadata=meta)
                o.completed = True
            except grpc.aio.AioRpcError:
                result.complete_errors += 1
            finally:
                serving.pop(i, None)

        async def admit(i: int, o: Outcome) -> None:
            nonlocal in_flight
            a = o.arrival
            while True:
                o.request_id = f"{run_id}-{i}" + (f"-r{o.retries}" if o.retries else "")
                request = pb.AdmitRequest(
                    tenant_id=a.tenant.tenant_id, request_id=o.request_id, lane=a.tenant.lane,
                    prompt_tokens=a.prompt_tokens, max_tokens=a.max_tokens,
                )  # fmt: skip
                in_flight += 1
                t0 = time.perf_counter()
                try:
                    resp = await asyncio.wait_for(decide(request), ADMIT_DEADLINE_S)
                except grpc.aio.AioRpcError as exc:
                    o.error = exc.code().name
                    return
                except TimeoutError:
                    o.error = "DEADLINE_EXCEEDED"
                    return
                finally:
                    in_flight -= 1
                    o.latency_ms = (time.perf_counter() - t0) * 1000
                o.decision = (
                    pb.Decision.Name(pb.Decision.ValueType(resp.decision))
                    .removeprefix("DECISION_")
                    .lower()
                )
                o.reason = (
                    pb.Reason.Name(pb.Reason.ValueType(resp.reason)).removeprefix("REASON_").lower()
                )
                o.queue_wait_ms = resp.queue_wait_ms
                if resp.decision == pb.DECISION_ADMIT:
                    o.served_after_refusal = o.retries > 0
                    service = service_seconds(a.prompt_tokens, a.max_tokens, service_scale)
                    serving[i] = asyncio.create_task(
                        complete(i, o, resp.granted_max_tokens, service)
                    )
                    return
                if retry is None or not resp.retryable:
                    return
                ceiling = min(retry.cap_s, retry.base_s * 2**o.retries)
                wait = max(resp.retry_after_ms / 1000, rng.uniform(0, ceiling))
                slo = retry.slo_for(resp.lane or a.tenant.lane or "standard")
                if time.monotonic() - start + wait - a.at_s > slo:
                    o.gave_up = True  # a retry could no longer be served in time
                    return
                o.retries += 1
                await asyncio.sleep(wait)

        async def unary(request: pb.AdmitRequest) -> Answer:
            return answer_of(await stub.Admit(request, timeout=ADMIT_DEADLINE_S, metadata=meta))

        batcher = (
            StreamBatcher(stub, meta, batch_window_s, batch_max)
            if batch_window_s is not None
            else None
        )
        decide = batcher.decide if batcher is not None else unary

        async def sample() -> None:
            while True:
                t = time.monotonic() - start
                result.samples.append((t, in_flight, len(serving)))
                if on_tick is not None:
                    on_tick(t, sum(1 for o in outcomes if o.sent_s > 0))
                await asyncio.sleep(SAMPLE_S)

        if batcher is not None:
            await batcher.__aenter__()
        sampler = asyncio.create_task(sample())
        reporter = asyncio.create_task(report_loop(engine, stub.ReportLoad)) if engine else None
        admits: list[asyncio.Task[None]] = []
        for i, o in enumerate(outcomes):
            delay = o.arrival.at_s - (time.monotonic() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            o.sent_s = max(1e-9, time.monotonic() - start)
            if in_flight >= max_in_flight:
                o.error = "dropped"
                continue
            admits.append(asyncio.create_task(admit(i, o)))
        if admits:
            await asyncio.wait(admits)
        result.duration_s = time.monotonic() - start
        if engine is not None and serving:
            # What the engine is still serving gets DRAIN_S to finish, as a
            # sidecar's in-flight requests do at a rolling restart.
            await asyncio.wait(list(serving.values()), timeout=DRAIN_S)
        ended.set()  # settle at once what is still being served
        drained.set()
        if serving:
            await asyncio.wait(list(serving.values()))
        sampler.cancel()
        if reporter is not None:
            reporter.cancel()
        if batcher is not None:
            await batcher.__aexit__(None, None, None)
            result.batches = batcher.batches
    return result

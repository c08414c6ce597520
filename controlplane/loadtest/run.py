"""Open-loop load against a running control plane over gRPC.

Each arrival is one ``Admit`` at its time, whatever the answers before it
(open loop: a slow server does not slow the load down, as real traffic
does not). An admitted request is ``Complete``d after a simulated service
time, so that reservations are refunded as in production: prefill at
``PREFILL_TPS`` then ``DECODE_TPS`` tokens per second for its output,
times ``service_scale``. When the run ends, what is still being "served"
is completed at once with the tokens generated so far.

Calls the server holds (the pool gate's queue) are simply calls in flight:
their count over time is the report's queue depth, and the answer's
``queue_wait_ms`` the server-side wait.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from controlplane._proto.burstgate.v1 import admission_pb2 as pb
from controlplane._proto.burstgate.v1 import admission_pb2_grpc as pb_grpc
from controlplane.loadtest.profile import Arrival

PREFILL_TPS = 20_000.0
DECODE_TPS = 60.0
TTFT_BASE_S = 0.05
ADMIT_DEADLINE_S = 30.0
SAMPLE_S = 0.1


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


@dataclass
class RunResult:
    outcomes: list[Outcome]
    duration_s: float
    # Per SAMPLE_S: (t since start, Admit calls in flight, served in flight).
    samples: list[tuple[float, int, int]] = field(default_factory=list)
    complete_errors: int = 0


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
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.AdmissionServiceStub(channel)
        start = time.monotonic()

        async def complete(i: int, o: Outcome, granted: int, service_s: float) -> None:
            began = time.monotonic()
            generated = o.arrival.max_tokens if granted <= 0 else min(granted, o.arrival.max_tokens)
            try:
                await asyncio.wait_for(ended.wait(), timeout=service_s)
                # the run ended first: settle what was generated so far
                share = min(1.0, (time.monotonic() - began) / service_s) if service_s else 1.0
                generated = int(generated * share)
            except TimeoutError:
                pass  # served in full
            try:
                await stub.Complete(
                    pb.CompleteRequest(
                        tenant_id=o.arrival.tenant.tenant_id, request_id=f"{run_id}-{i}",
                        prompt_tokens=o.arrival.prompt_tokens, generated_tokens=generated,
                    ),
                    timeout=ADMIT_DEADLINE_S, metadata=meta,
                )  # fmt: skip
                o.completed = True
            except grpc.aio.AioRpcError:
                result.complete_errors += 1
            finally:
                serving.pop(i, None)

        async def admit(i: int, o: Outcome) -> None:
            nonlocal in_flight
            a = o.arrival
            request = pb.AdmitRequest(
                tenant_id=a.tenant.tenant_id, request_id=f"{run_id}-{i}", lane=a.tenant.lane,
                prompt_tokens=a.prompt_tokens, max_tokens=a.max_tokens,
            )  # fmt: skip
            in_flight += 1
            t0 = time.perf_counter()
            try:
                resp = await stub.Admit(request, timeout=ADMIT_DEADLINE_S, metadata=meta)
            except grpc.aio.AioRpcError as exc:
                o.error = exc.code().name
                return
            finally:
                in_flight -= 1
                o.latency_ms = (time.perf_counter() - t0) * 1000
            o.decision = pb.Decision.Name(resp.decision).removeprefix("DECISION_").lower()
            o.reason = pb.Reason.Name(resp.reason).removeprefix("REASON_").lower()
            o.queue_wait_ms = resp.queue_wait_ms
            if resp.decision == pb.DECISION_ADMIT:
                service = service_seconds(a.prompt_tokens, a.max_tokens, service_scale)
                serving[i] = asyncio.create_task(complete(i, o, resp.granted_max_tokens, service))

        async def sample() -> None:
            while True:
                t = time.monotonic() - start
                result.samples.append((t, in_flight, len(serving)))
                if on_tick is not None:
                    on_tick(t, sum(1 for o in outcomes if o.sent_s > 0))
                await asyncio.sleep(SAMPLE_S)

        sampler = asyncio.create_task(sample())
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
        ended.set()  # settle at once what is still being served
        if serving:
            await asyncio.wait(list(serving.values()))
        sampler.cancel()
    return result
